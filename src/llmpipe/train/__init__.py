"""The runtime every training stage shares: params → `TrainingArguments` (:mod:`.arguments`), the run loop with resume
and atomic save (:mod:`.loop`), checkpoints and run identity (:mod:`.checkpoints`), Trainer callbacks
(:mod:`.callbacks`), guards against silent failures (:mod:`.guards`), telemetry (:mod:`.throughput`,
:mod:`.profiling`), what a run shows while it trains (:mod:`.hooks`, :mod:`.progress`, :mod:`.samples`,
:mod:`.tensorboard`) and the streaming Trainer side (:mod:`.stream`)."""
