"""lm-eval's own IFEval scoring, reused for the project's offline IFEval-format items."""

from lm_eval.tasks.ifeval.utils import agg_inst_level_acc, process_results

__all__ = ["agg_inst_level_acc", "process_results"]
