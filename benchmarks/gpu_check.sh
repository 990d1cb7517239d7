#!/usr/bin/env bash
# One prepared check for a machine with one NVIDIA GPU and no package registry (about 8 minutes on an H200).
# Every part runs llmpipe's own stages (`python -m llmpipe.cli --task …`) and reads their metrics and logs:
#
#   mfu           pretrain a 134M-parameter Llama (12 × 768, vocab 32k, 128 blocks of 1024 tokens a step) in bf16
#                 with torch.compile and sdpa: steady-state tokens/s and MFU from the stage's telemetry; PASS at ≥ 45 %
#   packing_exact per-sample loss of SFT rows packed into one row (position_ids restarting, no mask) against each
#                 row alone, fp32, per attention implementation; PASS at max |diff| ≤ 1e-5
#   sft_packing   sft on the default data, unpacked and packed (sdpa): real (non-pad) tokens/s both ways
#   qlora         sft with a 4-bit (bitsandbytes nf4) base and LoRA, merged into the base reloaded in bf16: the
#                 merged model's logits against the adapter on the 4-bit base, and the final eval_loss on the merged model
#   liger         use_liger_kernel on and off for pretrain (compiled, as mfu), sft and dpo: tokens/s, peak memory,
#                 eval_loss; PASS when the loss matches within 2 % (the kernels compute the same function)
#   alpaca        sft_packing again on an Alpaca-like length mix (synthetic rows, log-normal lengths)
#
# Usage: [PYTHON=python3] benchmarks/gpu_check.sh [--wheels DIR] [--data DIR] [--out DIR] [--work DIR]
#                                               [--parts LIST] [--budget-s N] [--tiny]
#   --wheels DIR  pip-install every wheel in DIR (--no-index --no-deps) into a private folder first
#   --data DIR    a workspace already holding data/ and artifacts/tokenizer for this script's params (copied in);
#                 without it prepare, tokenizer and tokenize run here
#   --out DIR     logs (one per stage run) and summary.txt (default ./gpu_check_out)
#   --work DIR    where the runs work (default a new temp folder)
#   --parts LIST  comma-separated subset of mfu,packing_exact,sft_packing,qlora,liger,alpaca (default all, in this order)
#   --budget-s N  skip the parts that would start after N seconds (default 540)
#   --tiny        a 2-layer model and a few steps: checks this script on a machine without a GPU (CUDA-only parts
#                 must then be refused by llmpipe with its own message, which counts as a pass)
# Exit status: 0 when every part run passed.
set -uo pipefail

usage() { awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"; }
REPO=$(cd "$(dirname "$0")/.." && pwd)
WHEELS="" DATA="" OUT_DIR="$PWD/gpu_check_out" WORK="" TINY=0 BUDGET=540
PARTS=mfu,packing_exact,sft_packing,qlora,liger,alpaca
while (($#)); do
  case "$1" in
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift 2 ;;
    --data) DATA=$(cd "${2:?--data needs a folder}" && pwd); shift 2 ;;
    --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
    --work) WORK=${2:?--work needs a folder}; shift 2 ;;
    --parts) PARTS=${2:?--parts needs a list}; shift 2 ;;
    --budget-s) BUDGET=${2:?--budget-s needs seconds}; shift 2 ;;
    --tiny) TINY=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
done
for p in ${PARTS//,/ }; do
  [[ ,mfu,packing_exact,sft_packing,qlora,liger,alpaca, == *",$p,"* ]] || { echo "gpu_check.sh: --parts: unknown part '$p'" >&2; exit 2; }
done
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=${WORK:-$(mktemp -d -t llmpipe-gpu-check.XXXXXX)}
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd)
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

if [[ -n $WHEELS ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" "$WHEELS"/*.whl \
    || { echo "gpu_check.sh: installing the wheels in $WHEELS failed" >&2; exit 1; }
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PREFECT_SERVER_ANALYTICS_ENABLED=false
cd "$WORK" || exit 1

if ((TINY)); then
  MODEL='{hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 4, intermediate_size: 128, max_position_embeddings: 512}'
  VOCAB=1024 BLOCK=128 BATCH=4 STEPS=6 SFT_BATCH=4 SFT_SAMPLES=64 LEN=512 PREC=fp32 OPTIM=adamw_torch LIMIT_S=300
else
  MODEL='{hidden_size: 768, num_hidden_layers: 12, num_attention_heads: 12, num_key_value_heads: 12, intermediate_size: 2048, max_position_embeddings: 1024}'
  VOCAB=32000 BLOCK=1024 BATCH=128 STEPS=50 SFT_BATCH=16 SFT_SAMPLES=3892 LEN=1024 PREC=bf16 OPTIM=adamw_torch_fused LIMIT_S=240
fi
# Budgets are given as steps and the whole run trains, validates once at the end and saves; no samples are drawn.
QUIET="eval_steps: 100000, save_steps: 100000, num_eval_prompts: 0, logging_steps: 5"
cat >params.yaml <<EOF
tokenizer: {vocab_size: $VOCAB}
model: $MODEL
train: {precision: $PREC, optim: $OPTIM, dataloader_num_workers: 2, max_eval_samples: 128, $QUIET}
pretrain: {max_steps: $STEPS, max_length: $BLOCK, per_device_train_batch_size: $BATCH, per_device_eval_batch_size: $BATCH,
           lr: 0.0006, warmup_steps: 5}
sft: {max_steps: -1, num_train_epochs: 1, num_samples: $SFT_SAMPLES, max_length: $LEN, per_device_train_batch_size: $SFT_BATCH,
      per_device_eval_batch_size: $SFT_BATCH, warmup_steps: 5, lr: 0.0002}
dpo: {max_steps: $((TINY ? 4 : 40)), max_length: $((TINY ? 128 : 512)), per_device_train_batch_size: $((TINY ? 2 : 16)),
      per_device_eval_batch_size: $((TINY ? 2 : 16)), warmup_steps: 2}
EOF
COMPILED="distributed: {torch_compile: $( ((TINY)) && echo false || echo true)}"  # pretrain's fixed shapes only

status=0
T0=$SECONDS
# variant NAME YAML: params-NAME.yaml = params.yaml with YAML's sections merged over it, outputs under runs/NAME
variant() {
  "$PY" - "$1" "$2" <<'EOF'
import sys, yaml
name, over = sys.argv[1], yaml.safe_load(sys.argv[2]) or {}
raw = yaml.safe_load(open("params.yaml"))
raw["paths"] = {"output_root": f"runs/{name}"}
for key, value in over.items():
    raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
yaml.safe_dump(raw, open(f"params-{name}.yaml", "w"))
EOF
}
# stage NAME TASK [PARAMS]: run one stage on PARAMS (default params-NAME.yaml) with a time limit, its log in
# OUT_DIR/NAME.log
stage() {
  local name=$1 task=$2 config=${3:-params-$1.yaml} t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$LIMIT_S" "$PY" -m llmpipe.cli --task "$task" --config-path "$config" \
    >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  say "$(printf '  %-22s %-9s rc=%-3s %4ds' "$name" "$task" "$rc" $((SECONDS - t0)))"
  ((rc == 0)) || tail -n 15 "$OUT_DIR/$name.log" | sed 's/^/    | /' | tee -a "$SUMMARY"
  return $rc
}
# report SCRIPT ARGS…: a Python figure printer whose last line is PASS/FAIL/INFO
report() { "$PY" - "$@" 2>&1 | tee -a "$SUMMARY"; return "${PIPESTATUS[0]}"; }
begin() {  # begin PART: false when the part was not asked for or the time budget is spent
  [[ ,$PARTS, == *",$1,"* ]] || return 1
  if ((SECONDS - T0 > BUDGET)); then say "== $1: SKIPPED (past the ${BUDGET}s budget; rerun with --parts $1)"; return 1; fi
  say "== $1 ($((SECONDS - T0))s in)"
}
cuda() { "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; }

say "== gpu_check $(date -u +%FT%TZ) on $(hostname); llmpipe $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'tree')"
"$PY" - <<'EOF' 2>&1 | tee -a "$SUMMARY"
import importlib, torch
names = ["transformers", "trl", "peft", "accelerate", "datasets", "liger_kernel", "bitsandbytes", "flash_attn", "vllm"]
found = []
for n in names:
    try:
        found.append(f"{n} {importlib.import_module(n).__version__}")
    except Exception as err:  # what is missing is a figure of the machine, not a failure here
        found.append(f"{n} missing ({type(err).__name__})")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); " + ", ".join(found))
if torch.cuda.is_available():
    from llmpipe.train.throughput import device_peak_tflops, measure_matmul_tflops
    dev = torch.device("cuda")
    peak, name = device_peak_tflops(dev)
    print(f"device: {name}, {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB; bf16 peak: datasheet "
          f"{peak} TFLOP/s, measured 8192³ matmul {measure_matmul_tflops(dev):.0f} TFLOP/s")
else:
    print("device: no CUDA GPU")
EOF

if [[ -n $DATA ]]; then
  cp -r "$DATA/data" "$DATA/artifacts" . && say "data: copied from $DATA"
else
  for t in prepare tokenizer tokenize; do stage "data_$t" "$t" params.yaml || status=1; done
fi
mkdir -p models

# The figures of one training run, from its metrics and per-step log.
RUN_FIGURES='
import csv, json, statistics, sys
def figures(name, stage):
    m = json.load(open(f"runs/{name}/metrics/{stage}.json"))
    rows = [r for r in csv.DictReader(open(f"runs/{name}/logs/{stage}/train.csv")) if r.get("tokens_per_s")]
    steady = rows[2:] or rows[-1:]  # the first log windows hold compilation and warm-up
    tps = statistics.median(float(r["tokens_per_s"]) for r in steady)
    mfu = [float(r["mfu"]) for r in steady if r.get("mfu")]
    # seconds of training: each window'"'"'s tokens over its rate (the first window from 0)
    seen = [0.0] + [float(r["num_input_tokens_seen"]) for r in rows]
    train_s = sum((seen[i + 1] - seen[i]) / float(r["tokens_per_s"]) for i, r in enumerate(rows))
    return {"m": m, "tps": tps, "mfu": statistics.median(mfu) if mfu else None, "tokens": seen[-1],
            "train_s": train_s, "windows": len(steady)}
'

if begin mfu; then
  variant mfu "{$COMPILED}"
  if stage mfu pretrain; then
    report <<EOF || status=1
$RUN_FIGURES
f = figures("mfu", "pretrain")
m = f["m"]
print(f"pretrain: {m['num_parameters'] / 1e6:.1f} M parameters, {m['steps']} steps of $BATCH × $BLOCK tokens, "
      f"bf16 + torch.compile + sdpa: median of {f['windows']} steady windows {f['tps']:,.0f} tokens/s, "
      + (f"MFU {f['mfu']:.1%}" if f["mfu"] else "MFU not logged (no known peak)")
      + f"; peak memory {m['peak_memory_gb']:.1f} GB; eval loss {m['eval_loss']:.3f}")
ok = f["mfu"] is not None and f["mfu"] >= 0.45
print(f"mfu: {'PASS' if ok else 'FAIL'} (target: MFU ≥ 45 %)")
sys.exit(0 if ok or $TINY else 1)
EOF
  else status=1; fi
  [[ -d runs/mfu/models/pretrain ]] && cp -r runs/mfu/models/pretrain models/pretrain
fi
if [[ ! -d models/pretrain ]]; then  # mfu not run: a random base of the same shape for the sft parts
  "$PY" - <<'EOF'
from llmpipe.config import load_params
from llmpipe.models import build_model, load_tokenizer, save_model
params = load_params("params.yaml")
tok = load_tokenizer(params.paths.tokenizer)
save_model(build_model(params.model, tok), tok, "models/pretrain")
EOF
fi

if begin packing_exact; then
  report "$TINY" <<'EOF' || status=1
import json, sys, torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from llmpipe.models import load_tokenizer
tiny = sys.argv[1] == "1"
device = "cuda" if torch.cuda.is_available() else "cpu"
tok = load_tokenizer("artifacts/tokenizer")
rows = [json.loads(line) for line in open("data/sft/validation.jsonl")][:8]
seqs = [tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"][:256] for r in rows]
def per_sample(logits, ids):  # mean next-token loss of one sample's own positions, (L, V), (L,)
    return F.cross_entropy(logits[:-1].float(), ids[1:]).item()
worst = {}
for impl in ("sdpa", "eager", "flash_attention_2"):
    try:
        model = AutoModelForCausalLM.from_pretrained("models/pretrain", attn_implementation=impl,
                                                     dtype=torch.float32).to(device).eval()
    except Exception as err:
        print(f"packing_exact {impl}: not available here ({type(err).__name__}: {str(err).splitlines()[0][:120]})")
        continue
    with torch.no_grad():
        alone = [per_sample(model(torch.tensor([s], device=device)).logits[0], torch.tensor(s, device=device))
                 for s in seqs]
        ids = torch.tensor([sum(seqs, [])], device=device)
        pos = torch.cat([torch.arange(len(s)) for s in seqs])[None].to(device)
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]  # a cache would join them
    start, diffs = 0, []
    for s, a in zip(seqs, alone):
        diffs.append(abs(per_sample(logits[start:start + len(s)], ids[0, start:start + len(s)]) - a))
        start += len(s)
    worst[impl] = max(diffs)
    print(f"packing_exact {impl}: {len(seqs)} samples ({sum(map(len, seqs))} tokens in one row), per-sample loss "
          f"packed vs alone max |diff| {worst[impl]:.2e}")
ok = bool(worst) and all(d <= 1e-5 for d in worst.values())
print(f"packing_exact: {'PASS' if ok else 'FAIL'} (target: ≤ 1e-5 for every implementation that loads)")
sys.exit(0 if ok else 1)
EOF
fi

# sft_pair NAME DATA_ROOT: the same sft unpacked and packed; real tokens/s both ways (the same rows, one epoch)
sft_pair() {
  local name=$1 data=$2 ok=0
  variant "${name}_unpacked" "{paths: {data: $data}, sft: {packing: false}}"
  variant "${name}_packed" "{paths: {data: $data}, sft: {packing: true}}"
  stage "${name}_unpacked" sft || ok=1
  stage "${name}_packed" sft || ok=1
  ((ok == 0)) || return 1
  report "$name" <<EOF
$RUN_FIGURES
name = sys.argv[1]
u, p = figures(f"{name}_unpacked", "sft"), figures(f"{name}_packed", "sft")
real = p["tokens"] * p["m"]["packing_fill"]  # the real tokens of the epoch (the rest pads packs), the same in both runs
for label, f in (("unpacked", u), ("packed", p)):
    print(f"{name} {label}: {f['m']['steps']} steps, {f['tokens']:,.0f} input tokens ({real / f['tokens']:.0%} real), "
          f"{f['train_s']:.1f} s training: {real / f['train_s']:,.0f} real tokens/s; eval loss {f['m']['eval_loss']:.3f}; "
          f"peak memory {f['m']['peak_memory_gb']:.1f} GB")
print(f"{name}: INFO packed / unpacked real tokens/s = {u['train_s'] / p['train_s']:.2f}x")
EOF
}
if begin sft_packing; then
  sft_pair sft data || status=1
  [[ -d runs/sft_packed/models/sft ]] && cp -r runs/sft_packed/models/sft models/sft
fi

if begin qlora; then
  variant qlora "{sft: {packing: true, num_samples: $((TINY ? 32 : 1024)), peft: {method: lora, r: 16, lora_alpha: 32, target_modules: all-linear, load_in_4bit: true}}}"
  if stage qlora sft; then
    report <<'EOF' || status=1
import json, sys, torch
from transformers import AutoModelForCausalLM
m = json.load(open("runs/qlora/metrics/sft.json"))
merged = AutoModelForCausalLM.from_pretrained("runs/qlora/models/sft")
plain = type(merged).__module__.startswith("transformers.") and not hasattr(merged, "peft_config")
w = next(merged.parameters())
print(f"qlora: {m['num_trainable_parameters'] / 1e6:.2f} M trainable of {m['num_parameters'] / 1e6:.1f} M; merged into "
      f"the bf16 base: saved dtype {w.dtype}, plain transformers model {plain}; adapter on the 4-bit base vs merged: "
      f"logits max |diff| {m['merge_logits_max_abs_diff']:.3g}, mean {m['merge_logits_mean_abs_diff']:.3g} over "
      f"{m['merge_scored_tokens']} held-out tokens; eval loss merged {m['eval_loss']:.4f} (final evaluation), "
      f"4-bit {m['eval_loss_4bit']:.4f}, same tokens scored by hand: merged {m['eval_loss_merged']:.4f}, "
      f"trained {m['eval_loss_trained']:.4f}")
ok = plain and w.dtype == torch.bfloat16 and m["eval_loss"] == m["eval_loss_merged"]
print(f"qlora: {'PASS' if ok else 'FAIL'} (merged in bf16, loads as plain transformers, final eval on the merged model)")
sys.exit(0 if ok else 1)
EOF
  elif ((TINY)) && grep -q "load_in_4bit: QLoRA's 4-bit base (bitsandbytes) needs a CUDA GPU" "$OUT_DIR/qlora.log"; then
    say "qlora: refused without a GPU, as it must be (--tiny): PASS"
  else status=1; fi
fi

# liger_pair NAME TASK YAML: TASK with use_liger_kernel off and on (YAML merged into both)
liger_pair() {
  local name=$1 task=$2 over=$3 ok=0
  variant "${name}_liger_off" "$over"
  "$PY" - "$name" "$task" "$over" <<'EOF'
import sys, yaml
name, task, over = sys.argv[1], sys.argv[2], yaml.safe_load(sys.argv[3]) or {}
raw = yaml.safe_load(open(f"params-{name}_liger_off.yaml"))
raw["paths"]["output_root"] = f"runs/{name}_liger_on"
raw[task] = {**raw.get(task, {}), "use_liger_kernel": True}
yaml.safe_dump(raw, open(f"params-{name}_liger_on.yaml", "w"))
EOF
  if [[ $name != pretrain ]]; then stage "${name}_liger_off" "$task" || ok=1; fi  # pretrain's off run is mfu's
  if ! stage "${name}_liger_on" "$task"; then
    if ((TINY)) && grep -q "use_liger_kernel: Liger's kernels are Triton kernels for CUDA GPUs" "$OUT_DIR/${name}_liger_on.log"; then
      say "liger $name: refused without a GPU, as it must be (--tiny): PASS"; return $ok
    fi
    return 1
  fi
  ((ok == 0)) || return 1
  report "$name" "$task" <<EOF
$RUN_FIGURES
name, task = sys.argv[1], sys.argv[2]
off = figures("mfu" if name == "pretrain" else f"{name}_liger_off", task)
on = figures(f"{name}_liger_on", task)
for label, f in (("off", off), ("on", on)):
    print(f"liger {name} {label}: {f['tps']:,.0f} tokens/s" + (f", MFU {f['mfu']:.1%}" if f["mfu"] else "")
          + f", peak memory {f['m']['peak_memory_gb']:.2f} GB, eval loss {f['m']['eval_loss']:.4f}")
rel = abs(on["m"]["eval_loss"] - off["m"]["eval_loss"]) / abs(off["m"]["eval_loss"])
ok = rel <= 0.02
print(f"liger {name}: {'PASS' if ok else 'FAIL'} (eval loss within 2 %: {rel:.2%}); tokens/s x{on['tps'] / off['tps']:.2f}, "
      f"peak memory x{on['m']['peak_memory_gb'] / off['m']['peak_memory_gb']:.2f}")
if name == "pretrain" and on["mfu"] is not None:  # the same compiled run with Liger's fused cross-entropy
    best = max(on["mfu"], off["mfu"] or 0)
    print(f"mfu with liger: {'PASS' if best >= 0.45 else 'FAIL'} (target: MFU ≥ 45 %; best compiled run {best:.1%})")
sys.exit(0 if ok else 1)
EOF
}
if begin liger; then
  [[ -d runs/mfu ]] && { liger_pair pretrain pretrain "{$COMPILED}" || status=1; }
  liger_pair sft sft "{sft: {packing: true}}" || status=1
  [[ -d models/sft ]] || cp -r models/pretrain models/sft
  liger_pair dpo dpo "{}" || status=1
fi

if begin alpaca; then
  # Alpaca-like lengths (its instructions+inputs about 20-90 words, outputs a long tail to a few hundred): words of
  # the stdlib SFT text, log-normal counts, the same chat format as data/sft.
  "$PY" - <<'EOF'
import json, math, random, pathlib
rng = random.Random(0)
words = " ".join(json.loads(l)["messages"][1]["content"] for l in open("data/sft/train.jsonl")).split()
def text(mu, sigma, cap):
    n = min(cap, max(3, int(math.exp(rng.gauss(mu, sigma)))))
    i = rng.randrange(len(words) - n)
    return " ".join(words[i:i + n])
root = pathlib.Path("alpaca/sft"); root.mkdir(parents=True, exist_ok=True)
for split, n in (("train", 3000), ("validation", 200)):
    with open(root / f"{split}.jsonl", "w") as fh:
        for _ in range(n):
            fh.write(json.dumps({"messages": [{"role": "user", "content": text(3.3, 0.6, 300)},
                                              {"role": "assistant", "content": text(4.2, 0.9, 700)}]}) + "\n")
EOF
  sft_pair alpaca alpaca || status=1
fi

say "== vllm: BLOCKED on this machine: no vllm package here, and none can be brought (no package registry; its wheel is hundreds of MB, over what the device takes, and pins a torch of its own, while this machine's torch must stay)"
say "== fsdp2 + lora on two ranks: NOT RUN: this machine has $(nvidia-smi -L 2>/dev/null | wc -l) GPU(s); a one-rank world shards nothing"
say "== gpu_check: $( ((status == 0)) && echo PASS || echo FAIL) in $((SECONDS - T0)) s"
exit $status
