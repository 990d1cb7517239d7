"""PPO: the algorithm pieces against hand-computed values (arithmetic in the comments), then the `ppo`
stage on tiny real models: it trains and logs finite losses (a SIGKILLed run resuming with the same prompts:
test_resume.py)."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY_PARAMS
from safetensors.torch import load_file

from llmpipe.config import ParamsError, parse_params
from llmpipe.models import build_model, load_tokenizer, save_model
from llmpipe.rl.ppo.losses import (
    RunningMeanStd,
    entropy_from_logits,
    gae,
    kl_k1,
    kl_k3,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    policy_loss,
    shape_scores,
    token_rewards,
    value_loss,
    whiten,
)
from llmpipe.rl.prompts import IndexStream
from llmpipe.stages import ppo, prepare, tokenize, tokenizer


def close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol), (actual, expected)


# ---- the algorithm pieces ---------------------------------------------------------------------------------

def test_gae_on_a_three_token_trajectory_with_padding():
    # Real tokens t = 0, 1, 2; t = 3 is padding (its reward 5 and value 9 must be ignored).
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # gamma = 0.9, lam = 0.8, so gamma * lam = 0.72; the value after the last real token is 0.
    # delta_2 = 1 + 0.9 * 0   - 0.4 =  0.6     A_2 = 0.6
    # delta_1 = 0 + 0.9 * 0.4 - 0.2 =  0.16    A_1 = 0.16  + 0.72 * 0.6   =  0.592
    # delta_0 = 0 + 0.9 * 0.2 - 0.5 = -0.32    A_0 = -0.32 + 0.72 * 0.592 =  0.10624
    # returns = A + V = [0.60624, 0.792, 1.0], padding 0.
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.10624, 0.592, 0.6, 0.0]])
    close(ret, [[0.60624, 0.792, 1.0, 0.0]])


def test_gae_limits_monte_carlo_and_one_step_td():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[1.0, 1.0, 1.0]])
    mask = torch.ones(1, 3)
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = [6 - 1, 5 - 1, 3 - 1].
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    close(adv, [[5.0, 4.0, 2.0]])
    close(ret, [[6.0, 5.0, 3.0]])
    # lam = 0: A_t = delta_t = r_t + V_{t+1} - V_t = [1 + 1 - 1, 2 + 1 - 1, 3 + 0 - 1].
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)
    close(adv, [[1.0, 2.0, 2.0]])


def test_kl_estimators_k1_and_k3():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    # k1 = logp - ref = [-1 + 1.5, -2 + 1] = [0.5, -1.0]
    close(kl_k1(logp, ref), [0.5, -1.0])
    # log r = ref - logp = [-0.5, 1.0]; r = [e^-0.5, e^1] = [0.6065306597, 2.7182818285]
    # k3 = (r - 1) - log r = [0.6065306597 - 1 + 0.5, 2.7182818285 - 1 - 1] = [0.1065306597, 0.7182818285]
    close(kl_k3(logp, ref), [0.1065306597, 0.7182818285])
    # Identical policies: both 0.
    close(kl_k3(logp, logp), [0.0, 0.0])


def test_masked_mean_and_unbiased_var_skip_padding():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # Real values 1, 2, 3, 4: mean 2.5; squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; unbiased var 5 / 3.
    close(masked_mean(x, mask), 2.5)
    close(masked_var(x, mask), 5 / 3)
    close(masked_var(x, mask, unbiased=False), 5 / 4)
    # Row means: [6 / 3, 4 / 1].
    close(masked_mean(x, mask, dim=1), [2.0, 4.0])
    with pytest.raises(ValueError, match="selects no element"):
        masked_var(x, torch.zeros_like(mask))


def test_whitening_of_advantages_and_rewards():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # mean 2.5, std sqrt(5 / 3) = 1.2909944; (x - 2.5) / 1.2909944 = [-1.161895, -0.387298, 0.387298, 1.161895]
    # Advantages: shift_mean=True (mean 0, std 1), padding 0.
    close(whiten(x, mask), [[-1.161895, -0.387298, 0.387298], [1.161895, 0.0, 0.0]])
    # Rewards: shift_mean=False adds the mean 2.5 back: [1.338105, 2.112702, 2.887298, 3.661895].
    close(whiten(x, mask, shift_mean=False), [[1.338105, 2.112702, 2.887298], [3.661895, 0.0, 0.0]])


def test_clipped_policy_loss_and_clip_fraction():
    ratios = torch.tensor([[1.5, 0.5, 1.1, 0.7, 3.0]])
    old = torch.zeros(1, 5)
    logp = ratios.log()  # so exp(logp - old) = ratios
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])  # the last token is padding
    # cliprange 0.2: per token max(-A * r, -A * clip(r, 0.8, 1.2))
    #   r=1.5, A= 1: max(-1.5, -1.2) = -1.2   clipped term larger → clipped
    #   r=0.5, A= 1: max(-0.5, -0.8) = -0.5
    #   r=1.1, A=-1: max( 1.1,  1.1) =  1.1   equal → not counted as clipped
    #   r=0.7, A=-1: max( 0.7,  0.8) =  0.8   clipped
    # loss = (-1.2 - 0.5 + 1.1 + 0.8) / 4 = 0.05; clip fraction 2 / 4 = 0.5
    # approx KL = 0.5 * mean(log(r)^2) = 0.5 * (0.164402 + 0.480453 + 0.009084 + 0.127217) / 4 = 0.0976445
    out = policy_loss(logp, old, adv, mask, cliprange=0.2)
    close(out.loss, 0.05)
    close(out.clip_fraction, 0.5)
    close(out.approx_kl, 0.0976445)


def test_policy_loss_gradient_stops_where_clipped():
    logp = torch.tensor([[math.log(1.5), math.log(0.5)]], requires_grad=True)
    out = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), cliprange=0.2)
    out.loss.backward()
    # Token 0 is clipped (ratio 1.5 > 1.2 with A > 0): no gradient. Token 1: d/dlogp (-A * r) / 2 = -0.5 / 2.
    close(logp.grad, [[0.0, -0.25]])


def test_clipped_value_loss():
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[1.5, 0.95, 0.0, 7.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # cliprange_value 0.2: V_clip = old + clip(V - old, -0.2, 0.2) = [1.2, 0.95, 0.8]
    #   (1.5 - 2)^2 = 0.25    (1.2 - 2)^2 = 0.64   → 0.64  clipped
    #   (0.95 - 0)^2 = 0.9025 (0.95 - 0)^2 = 0.9025 → 0.9025
    #   (0 - 1)^2 = 1         (0.8 - 1)^2 = 0.04   → 1
    # loss = 0.5 * (0.64 + 0.9025 + 1) / 3 = 0.42375; clip fraction 1 / 3
    loss, clip = value_loss(values, old, returns, mask, cliprange_value=0.2)
    close(loss, 0.42375)
    close(clip, 1 / 3)


def test_entropy_and_logprobs_from_logits():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    # Uniform over 2: ln 2 = 0.693147. p = [1/4, 3/4]: -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    close(entropy_from_logits(logits), [[0.693147, 0.562335]])
    # log p(token 1) = [ln 0.5, ln 0.75] = [-0.693147, -0.287682]
    close(logprobs_from_logits(logits, torch.tensor([[1, 1]])), [[-0.693147, -0.287682]])


def test_running_mean_std_after_two_batches_matches_numpy_and_round_trips():
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    rms.update(torch.tensor([10.0, 20.0]))
    # Merge of (mean 2, var 2/3, n 3) and (mean 15, var 25, n 2): delta 13,
    # M2 = 2/3 * 3 + 25 * 2 + 13^2 * 3 * 2 / 5 = 2 + 50 + 202.8 = 254.8, var = 254.8 / 5 = 50.96, mean 7.2
    everything = np.array([1.0, 2.0, 3.0, 10.0, 20.0])
    assert rms.count == 5
    assert rms.mean == pytest.approx(everything.mean()) == pytest.approx(7.2)
    assert rms.var == pytest.approx(everything.var()) == pytest.approx(50.96)
    restored = RunningMeanStd()
    restored.load_state_dict(rms.state_dict())
    assert restored.state_dict() == rms.state_dict()


def test_score_normalisation_clipping_and_missing_eos_penalty():
    scores = torch.tensor([1.0, 3.0])
    has_eos = torch.tensor([True, False])
    # batch: mean 2, population var 1 → [-1, 1]; clip 0.5 → [-0.5, 0.5]; no eos on the second: -1 → -0.5
    out = shape_scores(scores, has_eos, "batch", RunningMeanStd(), reward_clip=0.5, missing_eos_penalty=1.0)
    close(out, [-0.5, -0.5])
    close(shape_scores(scores, has_eos, "none", RunningMeanStd(), None, 0.0), [1.0, 3.0])
    # running, after an earlier batch [1, 2, 3]: stats of [1, 2, 3, 1, 3] are mean 2, var (1+0+1+1+1)/5 = 0.8
    rms = RunningMeanStd()
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    out = shape_scores(scores, has_eos, "running", rms, reward_clip=None, missing_eos_penalty=0.0)
    assert rms.count == 5
    close(out, [-1 / math.sqrt(0.8), 1 / math.sqrt(0.8)])


def test_token_rewards_put_the_score_on_the_last_real_token():
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # -0.5 * kl on real tokens; the score (2, -1) added at index 2 and index 0: -0.15 + 2 = 1.85, -0.25 - 1 = -1.25
    close(token_rewards(torch.tensor([2.0, -1.0]), kl, mask, kl_coef=0.5), [[-0.05, -0.1, 1.85], [-1.25, 0.0, 0.0]])


# ---- the stage on tiny real models ------------------------------------------------------------------------

TINY_PPO = {"max_steps": 10, "save_steps": 2, "logging_steps": 2, "eval_steps": 5}


def _params(output_root: Path, **ppo):
    """Tiny params writing under `output_root`; inputs are read relative to the working directory."""
    raw = yaml.safe_load(TINY_PARAMS)
    raw["ppo"] = {**raw["ppo"], **ppo}
    raw["paths"] = {"output_root": str(output_root)}
    return parse_params(raw)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """Prepared data, a trained tokenizer and its token files, a tiny (untrained) models/sft and a one-label
    models/reward on its backbone, and params.yaml (tiny, TINY_PPO steps) for `llm-train` run in this folder."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("ppo")
    params = _params(root)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        prepare.run(params)
        tokenizer.run(params)
        tokenize.run(params)  # the ptx term reads data/tokens/train
        tok = load_tokenizer(params.paths.tokenizer)
    sft = build_model(params.model, tok)
    save_model(sft, tok, root / "models" / "sft")
    # As TRL's RewardTrainer starts: the SFT backbone with a new one-label `score` head.
    reward = AutoModelForSequenceClassification.from_pretrained(root / "models" / "sft", num_labels=1)
    save_model(reward, tok, root / "models" / "reward")
    raw = yaml.safe_load(TINY_PARAMS)
    raw["ppo"] = {**raw["ppo"], **TINY_PPO}
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_ppo_trains_logs_finite_losses_and_changes_every_parameter(workdir, tmp_path, monkeypatch):
    """The non-default branches (k3, batch normalisation, clipping, reward whitening, eos penalty, ptx) here;
    the resume test below runs the defaults."""
    monkeypatch.chdir(workdir)
    knobs = {"kl_estimator": "k3", "normalize_method": "batch", "reward_clip": 2.0, "whiten_rewards": True,
             "missing_eos_penalty": 1.0, "ptx_coef": 0.5}
    metrics = ppo.run(_params(tmp_path, **knobs))

    assert metrics["steps"] == 4 and metrics["resumed_from_step"] == 0
    assert metrics["tokens_per_s"] > 0 and metrics["peak_memory_gb"] > 0.05
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    rows = list(csv.DictReader((tmp_path / "logs" / "ppo" / "train.csv").open()))
    assert [int(r["step"]) for r in rows] == [2, 4]
    for column in ("loss", "policy_loss", "value_loss", "ptx_loss", "reward", "kl", "entropy", "clip_fraction",
                   "approx_kl", "response_length", "tokens_per_s", "learning_rate", "peak_memory_gb"):
        assert all(math.isfinite(float(r[column])) for r in rows), column
    evals = list(csv.DictReader((tmp_path / "logs" / "ppo" / "eval.csv").open()))
    assert [int(r["step"]) for r in evals] == [4] and math.isfinite(float(evals[0]["eval_reward"]))
    # each reward's own validation mean, under TRL's name: what an RL stage's best checkpoint can be chosen by
    assert 0 <= float(evals[0]["eval_rewards/parsable_prefix/mean"]) <= 1

    before, after = _weights(workdir / "models" / "sft"), _weights(tmp_path / "models" / "ppo")
    assert before.keys() == after.keys()
    unchanged = [k for k in before if torch.equal(before[k], after[k])]
    assert unchanged == [], f"policy parameters not trained: {unchanged}"
    value_before = _weights(workdir / "models" / "reward")
    (checkpoint,) = (tmp_path / "checkpoints" / "ppo").glob("*/checkpoint-4")
    value_after = load_file(checkpoint / "model_1.safetensors")
    unchanged = [k for k in value_before if k in value_after and torch.equal(value_before[k], value_after[k])]
    assert unchanged == [], f"value parameters not trained: {unchanged}"

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "ppo")
    assert model.config.vocab_size == len(load_tokenizer(tmp_path / "models" / "ppo"))





@pytest.mark.slow  # its own 2 steps take ~5 s, but the module's workdir (prepare, tokenizer, tokenize) ~40 s more
def test_a_users_reward_function_reaches_the_logged_reward(workdir, tmp_path, user_reward_module, monkeypatch):
    import importlib

    monkeypatch.chdir(workdir)
    rewards = [{"name": f"{user_reward_module}:constant", "weight": 2.0}]
    metrics = ppo.run(_params(tmp_path, max_steps=2, reward_model=False, rewards=rewards))

    assert importlib.import_module(user_reward_module).CALLS, "the user's function was called"
    rows = list(csv.DictReader((tmp_path / "logs" / "ppo" / "train.csv").open()))
    assert [float(r["reward"]) for r in rows] == [0.5], "weight 2.0 × the function's 0.25, no reward model"
    assert metrics["eval_reward"] == 0.5


# ---- params ----------------------------------------------------------------------------------------------

def test_ppo_params_inherit_train_and_reject_mistakes_by_key():
    params = parse_params({"train": {"lr": 5e-4, "seed": 7}, "ppo": {"kl_coef": 0.1}})
    assert params.ppo.seed == 7 and params.ppo.lr == 5e-4 and params.ppo.kl_coef == 0.1
    with pytest.raises(ParamsError, match=r"ppo\.kl_estimator"):
        parse_params({"ppo": {"kl_estimator": "k2"}})
    with pytest.raises(ParamsError, match=r"ppo\.normalize_method"):
        parse_params({"ppo": {"normalize_method": "ema"}})
    with pytest.raises(ParamsError, match=r"ppo\.rewards\.0\.name: 'parses' is neither a built-in reward"):
        parse_params({"ppo": {"rewards": [{"name": "parses"}]}})
    with pytest.raises(ParamsError, match=r"ppo\.generation\.tempreature: unknown key; did you mean 'temperature'"):
        parse_params({"ppo": {"generation": {"tempreature": 0.7}}})
    with pytest.raises(ParamsError, match="ppo has no reward"):
        parse_params({"ppo": {"reward_model": False, "rewards": []}})
    with pytest.raises(ParamsError, match=r"ppo\.generation\.max_new_tokens \(256\) leaves no room"):
        parse_params({"ppo": {"max_length": 256, "generation": {"max_new_tokens": 256}}})


def test_index_stream_resumes_the_same_sequence_across_epochs():
    whole = IndexStream(5, seed=3)
    expected = [whole.take(3) for _ in range(4)]  # 12 indices: crosses two epoch boundaries
    assert sorted(expected[0] + expected[1][:2]) == list(range(5)), "each epoch is a permutation"
    first = IndexStream(5, seed=3)
    got = [first.take(3), first.take(3)]
    resumed = IndexStream(5, seed=3)
    resumed.load_state_dict(first.state_dict())
    got += [resumed.take(3), resumed.take(3)]
    assert got == expected
