"""lm-eval's task index for the serve stage's evaluation: the data stage's own task alone skips indexing lm-eval's
~15k built-in task files (7 s on 2 idle cores); any other name still finds lm-eval's built-in tasks."""
from __future__ import annotations

import time

import pytest

from tasks.data import lm_eval_task
from tasks.serve.lm_eval_worker import task_manager

pytestmark = pytest.mark.fast


def test_own_task_is_found_without_the_builtin_index_and_builtins_still_resolve(tmp_path, data_dir):
    folder = lm_eval_task.write_lm_eval_task(data_dir, tmp_path / "tasks")
    t0 = time.perf_counter()
    own = task_manager([lm_eval_task.TASK_NAME], folder)
    assert own.all_tasks == [lm_eval_task.TASK_NAME]
    assert time.perf_counter() - t0 < 5
    mixed = task_manager([lm_eval_task.TASK_NAME, "arc_easy"], folder)
    assert {lm_eval_task.TASK_NAME, "arc_easy"} <= set(mixed.all_tasks) and len(mixed.all_tasks) > 1000
