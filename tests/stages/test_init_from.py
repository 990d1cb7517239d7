"""`model.init_from`: the pipeline starts from a model a user already has (a Llama, a Qwen2, a GPT-2 built and saved
here, and one laid out as a hub id in a local Hugging Face cache), adopting its tokenizer; `pretrain.enabled: false`
writes a pointer, not a copy; errors name `model.init_from` (real `dvc repro`: tests/e2e/test_init_from.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from user_models import (
    PLAIN_TEMPLATE,
    QWEN_TEMPLATE,
    STEPS,
    chat_tokenizer,
    gpt2_tokenizer,
    hub_cache,
    params_at,
    pointer,
    run_stages,
    save_user_model,
    weights,
)

from llmpipe.config import parse_params
from llmpipe.config.loading import shadowed_train_keys
from llmpipe.core.errors import UserError
from llmpipe.models import build_model, init_model, load_model, load_tokenizer
from llmpipe.models.source import weights_dir


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A user's Llama with Qwen2.5's chat template (no generation markers), and the data stages run from it."""
    root = tmp_path_factory.mktemp("llama")
    source = save_user_model(root / "user_model", "llama", chat_tokenizer(QWEN_TEMPLATE))
    params = params_at(root, str(source))
    metrics = run_stages(params, "prepare", "tokenizer", "baseline", "pretrain")
    return root, source, params, metrics


def test_tokenizer_stage_adopts_the_models_tokenizer_and_marks_its_template(llama):
    root, source, params, metrics = llama
    from transformers import AutoTokenizer

    own, ours = AutoTokenizer.from_pretrained(source), load_tokenizer(params.paths.tokenizer)
    assert ours.get_vocab() == own.get_vocab() and metrics["tokenizer"]["vocab_size"] == len(own)
    assert "{% generation %}" in ours.chat_template and "{% generation %}" not in own.chat_template
    chat = [{"role": "user", "content": "Add 1 to x."}, {"role": "assistant", "content": "return x + 1"}]
    assert ours.apply_chat_template(chat, tokenize=False) == own.apply_chat_template(chat, tokenize=False)
    mask = ours.apply_chat_template(chat, return_dict=True, return_assistant_tokens_mask=True)["assistant_masks"]
    assert 0 < sum(mask) < len(mask), "the assistant turn, and only it, is marked"
    saved = load_tokenizer(Path(params.paths.models, "pretrain"))
    assert "generation %}" not in saved.chat_template, "the marked copy is for training: model folders get the plain one"
    assert saved.apply_chat_template(chat, tokenize=False) == own.apply_chat_template(chat, tokenize=False)


def test_pretrain_disabled_writes_a_pointer_that_loads_the_given_weights(llama):
    root, source, params, _ = llama
    for stage in ("pretrain", "baseline"):
        folder = Path(params.paths.models, stage)
        assert not list(folder.glob("*.safetensors")), f"models/{stage} holds no copy of the weights"
        assert sum(f.stat().st_size for f in folder.iterdir()) < 100_000
        assert pointer(folder)["init_from"] == str(source) and weights_dir(folder) == source
    loaded = load_model(Path(params.paths.models, "pretrain"), "?").state_dict()
    for name, tensor in weights(source).items():
        assert torch.equal(loaded[name], tensor), name


@pytest.mark.slow  # ~10 s; the real dvc repro of the same chain: tests/e2e/test_init_from.py
def test_sft_and_dpo_train_from_the_given_model(llama):
    root, source, params, _ = llama
    params = params_at(root, str(source), dpo=STEPS)
    metrics = run_stages(params, "sft", "dpo")
    assert metrics["sft"]["num_fully_truncated"] == 0 and metrics["dpo"]["steps"] == 2
    before, after = weights(source), weights(Path(params.paths.models, "sft"))
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    assert (Path(params.paths.models, "dpo") / "model.safetensors").exists()


def test_gpt2_without_pad_or_template_is_fitted_and_pretrained_further(tmp_path):
    tok = gpt2_tokenizer()
    source = save_user_model(tmp_path / "gpt2", "gpt2", tok)
    (tmp_path / "corpus.txt").write_text("\n\n".join(f"def f{i}(x):\n    return x * {i}\n" * 8 for i in range(40)))
    params = params_at(tmp_path, str(source), pretrain={"enabled": True, **STEPS},
                       data={"local": {"pretrain": str(tmp_path / "corpus.txt")}})
    metrics = run_stages(params, "prepare", "tokenizer", "tokenize", "pretrain")
    assert metrics["prepare"]["num_documents_train"] > 20, "a lone .txt file is cut into its paragraphs"
    ours = load_tokenizer(params.paths.tokenizer)
    assert len(ours) == len(tok) + 4 and ours.pad_token_id != ours.eos_token_id, "a pad token and the role tokens"
    out = Path(params.paths.models, "pretrain")
    model = load_model(out, "?")
    assert model.config.model_type == "gpt2" and model.get_input_embeddings().num_embeddings == len(ours)
    assert metrics["pretrain"]["steps"] == 2
    given = weights(source)["transformer.wte.weight"]
    assert not torch.equal(model.get_input_embeddings().weight[: len(tok)], given), "continued pretraining trained it"


def test_a_template_without_markers_trains_on_masks_computed_by_rendering(tmp_path, caplog):
    source = save_user_model(tmp_path / "qwen", "qwen2", chat_tokenizer(PLAIN_TEMPLATE), extra_rows=16)
    params = params_at(tmp_path, str(source))
    run_stages(params, "prepare", "tokenizer", "pretrain")
    with caplog.at_level("INFO", logger="llmpipe"):
        metrics = run_stages(params, "sft")["sft"]
    assert "assistant masks computed by rendering" in caplog.text
    assert metrics["steps"] == 2 and metrics["num_fully_truncated"] == 0, "every sample keeps its answer's labels"
    model = load_model(Path(params.paths.models, "pretrain"), "?")
    rows = json.loads((source / "config.json").read_text())["vocab_size"]
    assert model.config.model_type == "qwen2" and model.get_input_embeddings().num_embeddings == rows
    assert rows > len(load_tokenizer(params.paths.tokenizer)), "a padded vocabulary is kept as it is"


def test_wrong_vocabulary_architecture_or_path_name_init_from(llama, tmp_path):
    root, source, params, _ = llama
    other = save_user_model(tmp_path / "other", "llama", gpt2_tokenizer())
    with pytest.raises(UserError, match="model.init_from: .*vocabulary does not match"):
        init_model(params_at(root, str(other)).model, load_tokenizer(params.paths.tokenizer))
    small = tmp_path / "small"
    save_user_model(small, "llama", chat_tokenizer(QWEN_TEMPLATE))
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(UserError, match="model.init_from: .*embeds only 100 tokens"):
        init_model(params_at(root, str(small)).model, load_tokenizer(params.paths.tokenizer))
    (small / "config.json").write_text(json.dumps({**config, "model_type": "no_such_family"}))
    with pytest.raises(UserError, match="model.init_from: .*cannot read this architecture"):
        init_model(params_at(root, str(small)).model, load_tokenizer(params.paths.tokenizer))
    with pytest.raises(UserError, match="model.init_from: ./nowhere is not a folder"):
        init_model(params_at(root, "./nowhere").model, load_tokenizer(params.paths.tokenizer))


def test_a_hub_id_resolves_through_the_cache_offline(llama, tmp_path, monkeypatch):
    from huggingface_hub import constants

    root, source, params, _ = llama
    commit = "a" * 40
    hub_cache(tmp_path / "hub", "someone/tiny-llama", source, commit)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the cache only, as on a machine without network
    hub = params_at(root, "someone/tiny-llama")
    tokenizer = load_tokenizer(params.paths.tokenizer)
    model = init_model(hub.model, tokenizer)
    assert torch.equal(model.state_dict()["lm_head.weight"], weights(source)["lm_head.weight"])
    from llmpipe.models.source import write_pointer

    written = write_pointer(tmp_path / "pointer", hub.model, tokenizer)
    assert written["revision"] == commit and weights_dir(tmp_path / "pointer").name == commit
    with pytest.raises(UserError, match="model.init_from: 'someone/absent' .*no local folder"):
        init_model(params_at(root, "someone/absent").model, tokenizer)


def test_attn_implementation_applies_to_built_and_loaded_models(llama):
    root, source, params, _ = llama
    tokenizer = load_tokenizer(params.paths.tokenizer)
    eager = params_at(root, str(source), model={"attn_implementation": "eager"}).model
    assert init_model(eager, tokenizer).config._attn_implementation == "eager"
    assert load_model(source, "?", attn_implementation="eager").config._attn_implementation == "eager"
    scratch = parse_params({"model": {"attn_implementation": "eager"}}).model
    assert build_model(scratch, tokenizer).config._attn_implementation == "eager"
    if not torch.cuda.is_available():
        flash = params_at(root, str(source), model={"attn_implementation": "flash_attention_2"}).model
        with pytest.raises(UserError, match="model.attn_implementation: flash_attention_2 needs a CUDA GPU"):
            init_model(flash, tokenizer)


@pytest.mark.parametrize(("raw", "message"), [
    ({"pretrain": {"enabled": False}}, "pretrain.enabled is false but model.init_from is scratch"),
    ({"data": {"local": {"sft": "raw/alpaca.json"}}}, "data.local.sft is set but data.source is 'stdlib'"),
    ({"data": {"hf_preference": {"dataset_name": "x/y"}}}, "data.hf_preference.dataset_name is set but data.source"),
    ({"data": {"source": "local", "local": {"sft": "a.json"}}}, "data.local.pretrain is not set"),
    ({"model": {"init_from": "m"}, "tokenizer": {"kind": "pretrained", "name_or_path": "t"}},
     "model.init_from .* brings its own tokenizer"),
    ({"model": {"revision": "main"}}, "model.revision is set but model.init_from is scratch"),
])
def test_params_refuse_what_would_be_ignored_or_impossible(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_params(raw)


def test_sft_by_hand_before_the_pointer_exists_says_to_run_pretrain_which_trains_nothing(tmp_path):
    from llmpipe.stages.sft import SFT

    params = parse_params({"paths": {"models": str(tmp_path / "models")}, "model": {"init_from": "my/model"},
                           "data": {"source": "local", "local": {"sft": "a.json"}}, "pretrain": {"enabled": False}})
    with pytest.raises(UserError, match=r"models/pretrain: no model there; pretrain\.enabled is false, so the pretrain "
                                        r"stage writes there only a pointer to model\.init_from \(my/model\), in "
                                        r"seconds: run `llm-train --task pretrain` \(or dvc repro pretrain\) first"):
        SFT(params).load_model()


def test_no_pretraining_text_is_needed_when_nothing_is_pretrained():
    params = parse_params({"data": {"source": "local", "local": {"sft": "a.json"}},
                           "model": {"init_from": "m"}, "pretrain": {"enabled": False}})
    assert params.data.local.pretrain is None


def test_the_fine_tune_guides_example_validates():
    import re

    from conftest import ROOT

    from llmpipe.orchestration.scratch import merged_params

    guide = (ROOT / "docs" / "finetune.md").read_text()  # its one complete params.yaml change
    example = yaml.safe_load(re.search(r"```yaml\n(.*?)```", guide, re.S).group(1))
    params = parse_params(merged_params(ROOT, example))
    assert not params.model.scratch and not params.pretrain.enabled and params.data.local.pretrain is None
    assert not shadowed_train_keys(merged_params(ROOT, example)), "a train: key of the example that no stage reads"
    assert params.sft.per_device_train_batch_size == params.dpo.per_device_train_batch_size == 4
