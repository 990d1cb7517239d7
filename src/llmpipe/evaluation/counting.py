"""lm-eval's Hugging Face model, counting the inputs it cuts to fit the context instead of cutting them silently.

lm-eval's `HFLM` fits every request into ``max_length`` tokens by dropping tokens from the left: a
loglikelihood request (context + continuation) longer than ``max_length + 1`` loses the start of its context,
and a generation request's context is cut to ``max_length - max_gen_toks``. It logs a warning per request at
most and the score is computed as if nothing happened. llmpipe's own tasks leave over-long documents out
before lm-eval sees them (`tasks.render_tasks`); standard lm-eval tasks do not, so the count here is what
tells a user their scores are of cut inputs. Rolling-loglikelihood windows always fit and are never counted.

Imported only by `harness.evaluate` (it imports lm-eval, which takes seconds).
"""

from __future__ import annotations

from lm_eval.models.huggingface import HFLM


class CountingHFLM(HFLM):
    """`HFLM` with ``num_truncated``: the requests whose input was cut to fit ``max_length`` so far.

    Takes `HFLM`'s arguments; scores exactly as `HFLM` does.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_truncated = 0

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        """Count the (context, continuation) requests longer than ``max_length + 1`` tokens, then score as HFLM.

        Args:
            requests: ``((context, continuation), context_ids, continuation_ids)`` triples.
        """
        if self.backend == "causal":
            self.num_truncated += sum(len(ctx) + len(cont) > self.max_length + 1 for _, ctx, cont in requests)
        return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)

    def tok_batch_encode(self, strings, padding_side: str = "left", left_truncate_len: int | None = None,
                         truncation: bool = False):
        """Encode as HFLM does, counting the rows longer than `left_truncate_len` before cutting them.

        Returns:
            ``(input_ids, attention_mask)``, each (B, T) with T at most `left_truncate_len`.
        """
        ids, mask = super().tok_batch_encode(strings, padding_side=padding_side, truncation=truncation)
        if left_truncate_len and ids.shape[1] > left_truncate_len:
            self.num_truncated += int((mask.sum(1) > left_truncate_len).sum())
            ids, mask = ids[:, -left_truncate_len:], mask[:, -left_truncate_len:]
        return ids, mask
