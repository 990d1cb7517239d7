"""The `vlm` stage on the tiny workspace: a LLaVA model on the SFT model trains only what is not frozen, saves a
folder plain transformers loads and runs on an image, and scores itself per question type; its records and chat
template behave (killed-and-resumed run: test_resume.py; refused records: tests/unit/test_bad_input.py)."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import yaml
from conftest import TINY_PARAMS

from llmpipe.config import load_params
from llmpipe.config.data import ImagesParams
from llmpipe.data.image_records import typed_content
from llmpipe.data.images import QUESTION_TYPES, write_image_set

STEPS = {"max_steps": 4, "eval_steps": 4, "save_steps": 4, "logging_steps": 1, "warmup_steps": 0}


def vlm_params(root, name: str, **over):
    raw = yaml.safe_load(TINY_PARAMS)
    raw["vlm"] = {**raw["vlm"], **STEPS, **over}
    (root / f"params-{name}.yaml").write_text(yaml.safe_dump(raw))
    return load_params(root / f"params-{name}.yaml", {"paths.output_root": str(root / f"out-{name}")})


@pytest.mark.slow
def test_frozen_parts_stay_bit_identical_and_the_folder_loads_with_plain_transformers(tiny_sft, monkeypatch):
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from llmpipe.models import load_tokenizer
    from llmpipe.stages import vlm

    monkeypatch.chdir(tiny_sft)
    params = vlm_params(tiny_sft, "frozen", freeze_language_model=True, freeze_vision_tower=True)
    stage = vlm.VLM(params)
    stage.tokenizer = load_tokenizer(params.paths.tokenizer)
    initial = stage.load_model().state_dict()
    metrics = vlm.run(params)

    out = tiny_sft / "out-frozen"
    rows = list(csv.DictReader((out / "logs" / "vlm" / "train.csv").open()))
    assert len(rows) == STEPS["max_steps"] and all(r["loss"] != "" for r in rows)
    assert metrics["trainable_language_model"] == 0 and metrics["trainable_vision_tower"] == 0
    assert metrics["trainable_projector"] > 0
    for kind in QUESTION_TYPES:
        assert 0 <= metrics[f"test_accuracy_{kind}"] <= 1 and metrics[f"test_chance_{kind}"] > 0
        assert f"untrained_accuracy_{kind}" in metrics
    answers = [json.loads(line) for line in (out / "logs" / "vlm" / "answers" / "answers.jsonl").open()]
    assert [a["type"] for a in answers] == sorted(QUESTION_TYPES * 2), "two held-out images per question type"
    assert all((out / "logs" / "vlm" / "answers" / a["image"]).is_file() and a["expected"] for a in answers)

    from llmpipe.report import vlm as report_vlm

    (out / "figures").mkdir()
    images = report_vlm.copy_images(out / "logs" / "vlm" / "answers", out / "figures")
    section = "\n".join(report_vlm.section(metrics, out / "logs" / "vlm" / "answers", images))
    assert "| shape |" in section and section.count("](figures/vlm-") == len(answers)
    assert Image.open(out / "figures" / images[0]).size == (4 * 32, 4 * 32)

    model = AutoModelForImageTextToText.from_pretrained(out / "models" / "vlm")
    processor = AutoProcessor.from_pretrained(out / "models" / "vlm")
    trained = model.state_dict()
    frozen = [n for n in initial if "multi_modal_projector" not in n]
    changed = [n for n in frozen if not torch.equal(initial[n], trained[n])]
    assert not changed, f"frozen tensors changed: {changed}"
    projector = [n for n in initial if "multi_modal_projector" in n]
    assert projector and all(not torch.equal(initial[n], trained[n]) for n in projector)

    # docs/vlm.md's few lines: a held-out image and its question, answered by plain transformers.
    record = json.loads((tiny_sft / "data" / "vlm" / "test.jsonl").read_text().splitlines()[0])
    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": record["messages"][0]["content"].replace("<image>", "")}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    image = Image.open(tiny_sft / "data" / "vlm" / record["images"][0])
    inputs = processor(images=image, text=prompt, return_tensors="pt")
    answer = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert answer.shape[1] > inputs["input_ids"].shape[1]


def test_placeholders_and_typed_parts_render_the_same_tokens(tiny_sft):
    from llmpipe.models import load_tokenizer
    from llmpipe.vlm.model import build_processor

    params = load_params(tiny_sft / "params.yaml")
    processor = build_processor(load_tokenizer(tiny_sft / params.paths.tokenizer), params.vlm.vision)
    text = [{"role": "user", "content": "Look: <image> What colour?"}, {"role": "assistant", "content": "red"}]
    typed = [{"role": m["role"], "content": typed_content(m["content"])} for m in text]
    assert typed[0]["content"] == [{"type": "text", "text": "Look: "}, {"type": "image"},
                                   {"type": "text", "text": " What colour?"}]
    as_text = processor.apply_chat_template(text, tokenize=False)
    assert processor.apply_chat_template(typed, tokenize=False) == as_text
    assert as_text.count("<image>") == 1 and "<|assistant|>red" in as_text
    ids = processor.tokenizer(as_text, add_special_tokens=False)["input_ids"]
    assert ids.count(processor.tokenizer.convert_tokens_to_ids("<image>")) == 1, "<image> is one token"


def test_the_synthetic_set_is_seeded_balanced_and_readable(tmp_path):
    from PIL import Image

    cfg = ImagesParams(num_train=9, num_validation=3, num_test=6, image_size=24, seed=3)
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        assert write_image_set(tmp_path / name, cfg) == {"num_vlm_train": 9, "num_vlm_validation": 3,
                                                         "num_vlm_test": 6}  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "a" / "test.jsonl").read_text().splitlines()]
    assert [r["type"] for r in rows] == list(QUESTION_TYPES) * 2
    for r in rows:
        a, b = (Image.open(tmp_path / name / r["images"][0]) for name in ("a", "b"))
        assert a.size == (24, 24) and a.tobytes() == b.tobytes(), "same seed, same image"
        assert r["messages"][0]["content"].startswith("<image>")


def test_chat_talks_about_an_image_with_a_vlm_folder(tiny_sft, tmp_path, monkeypatch, capsys):
    import io
    import re
    import sys

    from llmpipe.cli import main
    from llmpipe.models import load_model, load_tokenizer
    from llmpipe.vlm.model import build_processor, build_vlm

    params = load_params(tiny_sft / "params.yaml")
    processor = build_processor(load_tokenizer(tiny_sft / params.paths.tokenizer), params.vlm.vision)
    model = build_vlm(load_model(tiny_sft / "models" / "sft", ""), processor, params.vlm)
    model.save_pretrained(tmp_path / "vlm")
    processor.save_pretrained(tmp_path / "vlm")
    image = tiny_sft / "data" / "vlm" / "images" / "test" / "00000.png"

    def chat(*flags: str) -> list[int]:
        monkeypatch.setattr(sys, "stdin", io.StringIO("What colour is it?\nAnd its shape?\n/quit\n"))
        code = main(["chat", "--model", str(tmp_path / "vlm"), "--max-new-tokens", "3", "--temperature", "0", *flags])
        err = capsys.readouterr().err
        assert code == 0, err
        return [int(n) for n in re.findall(r"\[(\d+) prompt tokens", err)]

    with_image, without = chat("--image", str(image)), chat()
    assert len(with_image) == 2 and with_image[1] > with_image[0]
    assert with_image[0] - without[0] == params.vlm.vision.num_image_tokens, "the image's tokens are in the prompt"

    assert main(["chat", "--model", str(tiny_sft / "models" / "sft"), "--image", str(image)]) == 2
    assert "is a text-only model" in capsys.readouterr().err


def save_tower(dest, kind: str, image_size: int = 32, patch_size: int = 8):
    """A tiny pretrained-tower folder as a user has one: a SigLIP or CLIP vision model and its image processor."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    shape = {"image_size": image_size, "patch_size": patch_size, "hidden_size": 32, "num_hidden_layers": 2,
             "num_attention_heads": 2, "intermediate_size": 64}  # fmt: skip
    torch.manual_seed(1)
    if kind == "siglip":
        SiglipVisionModel(SiglipVisionConfig(**shape)).save_pretrained(dest)
        SiglipImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(dest)
    else:
        CLIPVisionModel(CLIPVisionConfig(**shape)).save_pretrained(dest)
        CLIPImageProcessor(size={"shortest_edge": image_size},
                           crop_size={"height": image_size, "width": image_size}).save_pretrained(dest)  # fmt: skip
    return dest


@pytest.mark.parametrize("kind", ["siglip", "clip"])
def test_a_local_siglip_or_clip_tower_loads_into_the_vlm_stage(tiny_sft, tmp_path, monkeypatch, kind):
    from transformers import AutoModel

    from llmpipe.models import load_tokenizer
    from llmpipe.stages import vlm
    from llmpipe.vlm.scoring import accuracy_by_type

    monkeypatch.chdir(tiny_sft)
    tower = save_tower(tmp_path / kind, kind)
    params = vlm_params(tiny_sft, f"tower-{kind}", vision={"patch_size": 8, "path": str(tower)})
    stage = vlm.VLM(params)
    stage.tokenizer = load_tokenizer(params.paths.tokenizer)
    model = stage.load_model()
    loaded, saved = model.model.vision_tower.state_dict(), AutoModel.from_pretrained(tower).state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved), "the tower's weights"
    # held-out records through the stage's processor and model: the image tokens match the tower's patch features
    # (CLIP's class token dropped, as LLaVA does)
    scores = accuracy_by_type(model, stage.processor, stage.rows["test"][:2], stage.data)
    assert 0 <= scores["accuracy"] <= 1


def test_a_tower_of_another_size_than_the_params_is_refused(tiny_sft, tmp_path, monkeypatch):
    from llmpipe.core.errors import UserError
    from llmpipe.models import load_tokenizer
    from llmpipe.stages import vlm

    monkeypatch.chdir(tiny_sft)
    tower = save_tower(tmp_path / "siglip", "siglip", patch_size=4)
    stage = vlm.VLM(vlm_params(tiny_sft, "tower-mismatch", vision={"patch_size": 8, "path": str(tower)}))
    stage.tokenizer = load_tokenizer(stage.params.paths.tokenizer)
    with pytest.raises(UserError, match=r"vlm.vision.patch_size \(8\) make 16 tokens per image, but the tower in .* "
                                        r"4-pixel patches; set vlm.vision.image_size: 32 and vlm.vision.patch_size: 4"):
        stage.check_data(*stage.datasets())  # before any model loads
