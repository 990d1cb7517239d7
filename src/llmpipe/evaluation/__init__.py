"""lm-evaluation-harness (EleutherAI `lm-eval`) integration.

`tasks` defines llmpipe's own tasks and renders their data and YAMLs (in each model's own chat format) into a
work folder; `hooks` holds the `process_results` functions those YAMLs name; `harness` runs `simple_evaluate`
on a saved model directory and flattens the results to ``{"<task>.<metric>": float}``.
"""
