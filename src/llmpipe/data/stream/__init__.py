"""Streaming pretraining text (`data.streaming: true`): documents read, filtered, shuffled, tokenised and packed on
the fly, with a cursor that resumes at exactly the next token.

Pipeline, per rank::

    datasets streaming shard (IterableDataset.shard) → cut to data.max_chars_per_document → drop empty
    → drop documents whose hash puts them in validation/test (the split prepare made from its sample)
    → dedup (optional) → seeded shuffle buffer (per source) → mixture by weight → tokenise → eos → blocks

Why our own order and buffer: `datasets`' shuffle buffer loses its contents on resume and its batched arrow
`map` may skip a batch, so the resumable path keeps `datasets` to what it resumes exactly — one un-shuffled,
un-mapped shard at a time, whose ``state_dict()`` is its example position (on resume `datasets` re-reads that
shard's Arrow tables up to the position without decoding them into rows; nothing downstream is replayed). The
order is a seeded permutation of the shards per epoch plus a seeded buffer of `data.stream.shuffle_buffer`
documents whose contents are part of the cursor.

Ranks read disjoint data: whole shards when the shard count divides by the world size (rank r takes every
world-th shard of the epoch's permutation), otherwise every world-th document of the same order.

Packing: GPT-2 style — each document is followed by eos and blocks are cut across document boundaries;
attention is the model's plain causal mask, so it does cross document boundaries inside a block.

Modules: `source` (a source opened as a stream, and its documents for one rank in a seeded, resumable order),
`filter` (which documents are admitted: empty, held out, duplicates), `mixture` (sources drawn by weight, and
prepare's sample) and `packing` (the token blocks the trainer reads, and the cursor saved in checkpoints).
"""
