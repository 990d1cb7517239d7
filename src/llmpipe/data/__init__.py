"""Datasets the `prepare` stage builds: the embedded stdlib corpus (`stdlib`); users' data (`sources`), read from
their files (`local`, found and checked by `files`) or from hub datasets (`hub`; the named corpora are
`llmpipe.config.presets`), with record shapes normalised by `formats`; the seeded hash split shared by both
(`splits`), and the common result with its eval sets (`corpus`). Streaming pretraining reads a source as it trains (`stream`, a subpackage).
"""
