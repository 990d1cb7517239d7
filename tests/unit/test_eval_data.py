"""Evaluation follows the data: which llmpipe tasks apply to users' own data, how their greedy answers are scored,
and which of lm-eval's logged samples the report shows side by side (the stage on a real model:
tests/stages/test_evaluate.py and test_report_current.py)."""

from __future__ import annotations

from llmpipe.config import EVAL_TASKS
from llmpipe.evaluation.harness import first_answers
from llmpipe.evaluation.hooks import answer_score, preference_accuracy
from llmpipe.evaluation.tasks import LOCAL_TASKS, tasks_for


def test_evaluation_follows_the_data():
    """On users' own data no task grades stdlib Python: the code-generation task gives way to greedy answers scored
    against the held-out response, the signature task drops out; named lm-eval tasks stay."""
    shipped = [*EVAL_TASKS, "arc_easy"]
    assert tasks_for(shipped, stdlib=True) == shipped
    assert tasks_for(shipped, stdlib=False) == ["llmpipe_perplexity", "llmpipe_sft_chat", "llmpipe_sft_plain",
                                                "llmpipe_preference", "llmpipe_answers", "llmpipe_tasks", "arc_easy"]
    # llmpipe_tasks stays: a user's own tasks (data.local.tasks) are graded by their tests on any data
    assert all(LOCAL_TASKS[t].data == "any" for t in tasks_for(shipped, stdlib=False) if t in LOCAL_TASKS)
    assert answer_score({"reference": "return x + 1\n"}, [" return x + 1"]) == {"exact": 1.0, "distinct": "return x + 1"}
    assert answer_score({"reference": "yes"}, ["no"])["exact"] == 0.0
    assert preference_accuracy({"choices": ["a", "b"], "label": 0, "corruption": "none"}, [(-1.0, True), (-2.0, False)]
                               ) == {"acc": 1.0, "acc_norm": 1.0}  # users' pairs: no corruption type to break down
    results = {"samples": {"llmpipe_answers": [
        {"doc_id": i, "doc": {"prompt": f"p{i}", "reference": "r"}, "filtered_resps": [f"a{i}"]} for i in (2, 0, 1)],
        "llmpipe_sft_chat": [{"doc_id": 0, "doc": {}, "filtered_resps": [(-1.0, False)]}]}}
    assert first_answers(results, limit=2) == [{"task": "llmpipe_answers", "prompt": "p0", "answer": "a0"},
                                               {"task": "llmpipe_answers", "prompt": "p1", "answer": "a1"}]
