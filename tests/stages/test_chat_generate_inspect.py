"""`llm-train chat`, `generate` and `inspect` on tiny real models: llmpipe's models/sft, a peft adapter over it, a
user's own GPT-2 without chat template or pad token, and a checkpoint of a two-step pretrain run."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from llmpipe import stages
from llmpipe.cli import main
from llmpipe.config import load_params


@pytest.fixture(autouse=True)
def _restore_logging():
    """`main` points the root logger at the captured stderr; give the next test its own handlers back."""
    handlers = logging.getLogger().handlers[:]
    yield
    logging.getLogger().handlers[:] = handlers


STATS = re.compile(r"\[(\d+) prompt tokens, (\d+) new tokens")
TURNS = "def f(x):\ndef f(x):\n/clear\ndef f(x):\n/quit\n"
"""Two turns, /clear, a third turn equal to the first, /quit."""


@pytest.fixture(scope="module")
def models(tiny_sft, tmp_path_factory) -> dict[str, Path]:
    """models/sft (llmpipe's), a LoRA adapter over it (random B, so it changes the output; no tokenizer saved: the
    base's is used), and a user's GPT-2 whose tokenizer has neither chat template nor pad token."""
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("models")
    sft = tiny_sft / "models" / "sft"
    base = AutoModelForCausalLM.from_pretrained(sft)
    lora = LoraConfig(task_type="CAUSAL_LM", r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False)  # fmt: skip
    get_peft_model(base, lora).save_pretrained(root / "adapter")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(["def f(x): return x + 1", "hello world"] * 50,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", model_max_length=64)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2,
                                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id))  # fmt: skip
    gpt2.save_pretrained(root / "gpt2")
    tok.save_pretrained(root / "gpt2")
    return {"sft": sft, "adapter": root / "adapter", "gpt2": root / "gpt2"}


def _chat(monkeypatch, capsys, model: Path, turns: str, *flags: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
    code = main(["chat", "--model", str(model), "--max-new-tokens", "6", "--temperature", "1.0", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_chat_answers_each_turn_and_clear_forgets_the_history(models, monkeypatch, capsys):
    code, out, err = _chat(monkeypatch, capsys, models["sft"], TURNS)
    assert code == 0, err
    prompts = [int(n) for n, _ in STATS.findall(err)]
    assert len(prompts) == 3, err
    assert prompts[1] > prompts[0], "the second turn's prompt carries the first turn and its answer"
    assert prompts[2] == prompts[0], "after /clear the same message is rendered alone again"
    assert "[conversation cleared]" in err and out.strip(), "answers go to stdout"


def test_chat_leaves_out_the_oldest_turns_that_no_longer_fit(models):
    from llmpipe.commands.chat import Conversation
    from llmpipe.commands.generation import chat_ids, load_for_generation
    from llmpipe.core.errors import UserError

    _, tokenizer = load_for_generation(models["sft"])

    def render(messages):
        return chat_ids(tokenizer, messages), {}

    alone = len(Conversation(render, None, None).prompt_ids("hello there")[0])
    conversation = Conversation(render, None, limit=alone + 3)  # room for one message, not for two turns
    conversation.prompt_ids("hello there")
    conversation.answer("general kenobi")
    ids, _, dropped = conversation.prompt_ids("hello there")
    assert dropped == 2 and len(ids) == alone, "the first turn and its answer were left out"
    conversation.answer("general kenobi")
    before = list(conversation.turns)
    with pytest.raises(UserError, match="send a shorter one"):
        conversation.prompt_ids("hello there " * 20)
    assert conversation.turns == before, "a refused message leaves the conversation as it was"


def test_chat_needs_a_chat_template(models, monkeypatch, capsys):
    code, _, err = _chat(monkeypatch, capsys, models["gpt2"], TURNS)
    assert code == 2 and "no chat template" in err and "llm-train generate" in err


@pytest.mark.parametrize("name", ["sft", "adapter", "gpt2"])
def test_generate_writes_one_line_per_prompt(models, name, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "def f(x):", "id": 1}, {"prompt": "hello"}]
    if name != "gpt2":  # a message list needs a chat template
        rows.append({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(models[name]), "--prompt", "import os", "--file", str(prompts),
            "--out", str(out), "--max-new-tokens", "5", "--batch-size", "2"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 1 + len(rows), "one line per prompt: --prompt first, then the file's"
    assert lines[0]["prompt"] == "import os" and lines[1]["id"] == 1 and lines[-1].keys() >= rows[-1].keys()
    assert all(0 < line["num_new_tokens"] <= 5 and isinstance(line["completion"], str) for line in lines)
    if name == "gpt2":
        assert "no chat template" in capsys.readouterr().err, "the plain-text fallback is said"
    assert main(["generate", "--model", str(models[name]), "--prompt", "x", "--max-new-tokens", "3"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1, "without --out, one line on stdout"


def test_an_adapter_loads_over_its_base_and_changes_it(models):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from llmpipe.commands.generation import load_for_generation

    adapter, _ = load_for_generation(models["adapter"])  # the stages' loader: the adapter merged into its base
    base, tokenizer = load_for_generation(models["sft"])
    by_hand = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(models["sft"]), models["adapter"])
    ids = torch.tensor([tokenizer("def f(x):")["input_ids"]])
    with torch.no_grad():
        assert not torch.allclose(adapter(ids).logits, base(ids).logits), "the LoRA weights are applied"
        assert torch.allclose(adapter(ids).logits, by_hand(ids).logits, atol=1e-5)


@pytest.mark.parametrize(("setup", "argv", "message"), [
    (None, ["--model", "{root}/nowhere", "--prompt", "x"], "no such folder"),
    ("{\"prompt\": \"ok\"}\n{\"prompt\": 3}\n", ["--model", "{sft}", "--file", "{file}"], r"prompts\.jsonl:2: "),
    ("{\"prompt\": \"ok\"}\nnot json\n", ["--model", "{sft}", "--file", "{file}"], r"prompts\.jsonl:2: not valid"),
    (None, ["--model", "{sft}", "--file", "{root}/missing.jsonl"], "no such file"),
    (None, ["--model", "{sft}"], "no prompt"),
    (None, ["--model", "{sft}", "--prompt", "x", "--top-p", "0"], "--top-p"),
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n", ["--model", "{gpt2}", "--file", "{file}"],
     "no chat template"),
])  # fmt: skip
def test_generate_refuses_bad_input_with_one_line(models, tmp_path, capsys, setup, argv, message):
    prompts = tmp_path / "prompts.jsonl"
    if setup:
        prompts.write_text(setup)
    fill = {"root": tmp_path, "sft": models["sft"], "gpt2": models["gpt2"], "file": prompts}
    out = tmp_path / "out.jsonl"
    assert main(["generate", *(a.format(**fill) for a in argv), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.count("\n") == 1, err
    assert not out.exists(), "nothing written"


def test_an_adapter_whose_base_is_gone_is_refused(models, tmp_path, capsys):
    moved = tmp_path / "adapter"
    shutil.copytree(models["adapter"], moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(moved), "--prompt", "x"]) == 2
    assert "base_model_name_or_path" in capsys.readouterr().err


# ---- inspect, on a checkpoint of a two-step pretrain run ----------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(workdir) -> Path:
    """A two-step pretrain run in `workdir`, checkpointed at step 2; returns the checkpoint folder."""
    raw = yaml.safe_load((workdir / "params.yaml").read_text())
    raw["pretrain"] = {**raw.get("pretrain", {}), "max_steps": 2, "save_steps": 2, "eval_steps": 2,
                       "logging_steps": 1, "warmup_steps": 1}  # fmt: skip
    (workdir / "params.yaml").write_text(yaml.safe_dump(raw))
    cwd = Path.cwd()
    os.chdir(workdir)
    try:
        stages.runner("pretrain")(load_params("params.yaml"))
    finally:
        os.chdir(cwd)
    (found,) = (workdir / "checkpoints" / "pretrain").glob("*/checkpoint-2")
    return found


def test_inspect_shows_step_loss_data_and_the_params_difference(checkpoint, monkeypatch, capsys):
    workdir = checkpoint.parents[3]
    monkeypatch.chdir(workdir)
    assert main(["inspect", str(checkpoint)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^step +2 of 2$", out, re.MULTILINE), out
    assert re.search(r"^train +loss \d", out, re.MULTILINE), out
    assert re.search(r"^validation +eval_loss \d", out, re.MULTILINE), out
    assert "batch ledger: 2 steps" in out and "input tokens seen" in out
    assert f"fingerprint {checkpoint.parent.name}" in out and "llm-train --task pretrain resumes this run" in out

    params = workdir / "params.yaml"
    raw = yaml.safe_load(params.read_text())
    raw["pretrain"]["lr"] = 0.0123
    params.write_text(yaml.safe_dump(raw))
    assert main(["inspect", str(checkpoint.parent)]) == 0, "a run folder: its newest checkpoint"
    out = capsys.readouterr().out
    assert "differs from params.yaml" in out and "pretrain.lr: 0.001 → 0.0123" in out, out
    assert main(["inspect", str(checkpoint.parent / "checkpoint-9")]) == 2
    assert "no such folder" in capsys.readouterr().err


# ---- chat as a person runs it: a separate process over a pipe, and in a terminal under tmux ----------------------


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def _chat_cmd(model: Path) -> list[str]:
    return [sys.executable, "-m", "llmpipe.cli", "chat", "--model", str(model), "--max-new-tokens", "6",
            "--temperature", "1.0"]  # fmt: skip


@pytest.mark.slow
def test_chat_over_a_pipe(models):
    proc = subprocess.run(_chat_cmd(models["sft"]), input=TURNS, capture_output=True, text=True, env=_env(),
                          check=False, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    prompts = [int(n) for n, _ in STATS.findall(proc.stderr)]
    assert len(prompts) == 3 and prompts[0] == prompts[2] < prompts[1], proc.stderr
    assert "you>" not in proc.stdout, "no prompt string when stdin is not a terminal"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install -y tmux)")
def test_chat_in_a_terminal_under_tmux(models, tmp_path):
    server = ["tmux", "-L", f"llmpipe-test-{os.getpid()}"]  # a private server: other tmux sessions are not touched
    script = tmp_path / "chat.sh"
    script.write_text(f"{' '.join(_chat_cmd(models['sft']))}; echo EXIT=$?; sleep 60\n")
    env = _env()
    subprocess.run([*server, "new-session", "-d", "-s", "chat", "-x", "160", "-y", "50", f"bash {script}"],
                   env=env, check=True)  # fmt: skip

    def screen() -> str:
        return subprocess.run([*server, "capture-pane", "-p", "-t", "chat", "-S", "-200"], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip

    def wait_for(pattern: str, count: int = 1, timeout_s: float = 240) -> str:
        deadline = time.time() + timeout_s
        while len(re.findall(pattern, text := screen())) < count:
            assert time.time() < deadline, f"no {pattern!r} x{count} on the screen:\n{text}"
            time.sleep(0.3)
        return text

    try:
        wait_for(r"you>")  # capture-pane drops trailing blanks
        for turn in (1, 2):
            subprocess.run([*server, "send-keys", "-t", "chat", "def f(x):", "Enter"], check=True)
            wait_for(r"\[\d+ prompt tokens", turn)
        subprocess.run([*server, "send-keys", "-t", "chat", "/quit", "Enter"], check=True)
        text = wait_for(r"EXIT=\d+")
        assert "EXIT=0" in text, text
        assert len(re.findall(r"you> def f\(x\):", text)) == 2, text
    finally:
        subprocess.run([*server, "kill-server"], check=False)
