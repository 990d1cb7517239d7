"""`tokenizer` stage: a byte-level BPE trained on the pretraining split, a named tokenizer, or (with
``model.init_from``) the model's own tokenizer and chat template, saved with its special tokens and a chat template
to ``paths.tokenizer``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

from llmpipe.config import Params
from llmpipe.core.errors import UserError, root_cause
from llmpipe.core.io import atomic_dir, read_jsonl
from llmpipe.data.special import install, jinja_escape
from llmpipe.models import check_tokenizer_configs
from llmpipe.models.source import checked_source, resolve

log = logging.getLogger(__name__)

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")


def chat_template(special_tokens: tuple[str, ...]) -> str:
    """The pipeline's chat template, escaping `special_tokens` in message contents.

    Each turn is ``<|role|><content>\\n`` and an assistant turn ends with eos, so generation stops there. The role
    token is special, so the prompt rendered alone is a token prefix of prompt + completion (no merge across the
    boundary, which DPO and lm-eval rely on). ``{% generation %}`` marks the assistant tokens TRL's
    `assistant_only_loss` trains on. Contents are escaped (`llmpipe.data.special`), so special-token text typed
    in a message stays text and only the template's own markers are control tokens.
    """
    content = jinja_escape("message['content']", special_tokens)
    return (
        "{{ bos_token }}"
        "{% for message in messages %}"
        "{{ '<|' + message['role'] + '|>' }}"
        "{% if message['role'] == 'assistant' %}"
        f"{{% generation %}}{{{{ {content} + eos_token }}}}{{% endgeneration %}}"
        f"{{% else %}}{{{{ {content} }}}}{{% endif %}}"
        "{{ '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )


def _use_our_chat_template(tok) -> None:
    """Give `tok` the pipeline's chat template and the normalizer that deletes its escape (a tokenizer without a
    `tokenizers` backend gets the template without escaping: it could not delete the escape)."""
    if getattr(tok, "backend_tokenizer", None) is None:
        tok.chat_template = chat_template(())
        return
    install(tok)
    tok.chat_template = chat_template(tuple(tok.all_special_tokens))


def _texts(path: Path) -> Iterator[str]:
    for row in read_jsonl(path):
        yield row["text"]


def train_bpe(texts: Iterator[str], vocab_size: int, min_frequency: int, model_max_length: int):
    """Train a byte-level BPE (GPT-2 style, `tokenizers` library) and wrap it for transformers.

    Args:
        texts: Training documents.
        vocab_size: Vocabulary size in tokens, special tokens included.
        min_frequency: Minimum count of a pair to be merged.
        model_max_length: Longest sequence in tokens the tokenizer reports.

    Returns:
        A `PreTrainedTokenizerFast` with bos/eos/pad (pad distinct from eos), role tokens and the chat template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[PAD, BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        model_max_length=model_max_length,
    )
    _use_our_chat_template(tok)
    return tok


def load_pretrained(name_or_path: str, model_max_length: int, trust_remote_code: bool = False,
                    key: str = "tokenizer.name_or_path"):
    """Load a named or local tokenizer; add a pad token and our chat template when it has none, and
    ``{% generation %}`` markers to a known template without them (:func:`mark_generation`).

    Args:
        name_or_path: A hub name or a local folder.
        model_max_length: Longest sequence in tokens the tokenizer reports.
        trust_remote_code: Let a tokenizer whose config maps to Python code (``auto_map``) load.
        key: The params key that names it (in messages).

    Raises:
        UserError: The tokenizer cannot be found (offline, a hub name must already be in the local cache), or a
            local folder maps to code and is not trusted (names the config file and ``--trust-remote-code``).
    """
    from transformers import AutoTokenizer

    if Path(name_or_path).is_dir():
        check_tokenizer_configs(Path(name_or_path), trust_remote_code)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        raise UserError(f"{key}: cannot load the tokenizer of {name_or_path!r}: {root_cause(err)}") from None
    if tok.pad_token is None or tok.pad_token == tok.eos_token:
        tok.add_special_tokens({"pad_token": PAD})
    if tok.chat_template is None:
        tok.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
        _use_our_chat_template(tok)
    mark_generation(tok, key)
    tok.model_max_length = model_max_length
    return tok


def mark_generation(tok, key: str) -> None:
    """Give `tok` the training version of its chat template when that has no ``{% generation %}`` markers.

    TRL's `assistant_only_loss` (``sft.assistant_only_loss``) finds the assistant tokens through these markers;
    most hub templates have none. TRL keeps marked copies of the common families' templates
    (`trl.chat_template_utils.get_training_chat_template`), which render the same text. For another template
    the tokenizer is kept as it is: the sft stage then computes the assistant masks by rendering each conversation
    turn by turn (`llmpipe.data.chat_turns`). Either way the marked copy lives only here, where training reads it:
    every model folder is saved with the plain template (`llmpipe.models.saved_folder`).
    """
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    if has_generation_markers(tok.chat_template):
        return
    try:
        tok.chat_template = get_training_chat_template(tok) or tok.chat_template
        log.info("%s: chat template without {%% generation %%} markers; using TRL's marked version of it", key)
    except ValueError:
        log.info("%s: the chat template has no {%% generation %%} markers and TRL has no marked version of it; sft "
                 "computes its assistant masks by rendering each conversation turn by turn", key)


def run(params: Params, trust_remote_code: bool = False) -> dict[str, float]:
    """Build the tokenizer and save it to ``paths.tokenizer``; returns vocab size and characters per token.

    Args:
        params: Validated params; reads ``paths``, ``tokenizer``, ``model.init_from`` and ``model.revision``.
        trust_remote_code: Let a pretrained tokenizer that maps to Python code load (``--trust-remote-code``).

    Raises:
        UserError: A missing pretraining split (a BPE to train), or a tokenizer or ``model.init_from`` that cannot
            be loaded or whose vocabulary does not fit its model.
    """
    cfg = params.tokenizer
    data = Path(params.paths.data, "pretrain")
    if not params.model.scratch:  # the model's own tokenizer: nothing is trained
        source = resolve(params.model.init_from, params.model.revision)
        tok = load_pretrained(str(source), cfg.model_max_length, trust_remote_code, "model.init_from")
        checked_source(params.model, tok, trust_remote_code)
    elif cfg.kind == "train":
        train_file = data / "train.jsonl"
        if not train_file.exists():
            raise UserError(f"{train_file}: missing; run the prepare stage first (dvc repro prepare)")
        tok = train_bpe(_texts(train_file), cfg.vocab_size, cfg.min_frequency, cfg.model_max_length)
    else:
        tok = load_pretrained(cfg.name_or_path, cfg.model_max_length, trust_remote_code)
    sample = [row["text"] for row in read_jsonl(data / "validation.jsonl")]
    n_chars = sum(len(t) for t in sample)
    n_tokens = sum(len(ids) for ids in tok(sample, split_special_tokens=True, verbose=False)["input_ids"]) if sample else 0
    with atomic_dir(params.paths.out(params.paths.tokenizer)) as tmp:
        tok.save_pretrained(tmp)
    log.info("tokenizer: %d tokens, %.2f characters per token on validation", len(tok), n_chars / max(n_tokens, 1))
    return {"vocab_size": len(tok), "chars_per_token_validation": round(n_chars / max(n_tokens, 1), 4)}
