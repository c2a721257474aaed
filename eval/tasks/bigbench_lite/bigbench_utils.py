"""Scoring of the BIG-bench Lite tasks (eval/tasks/bigbench_lite/*.yaml), as BIG-bench's own metrics define it
(bigbench/api/task_metrics.py of the sdist, bigbench/models/model_utils.py::postprocess_output).

- multiple_choice_grade: the target_scores value of the choice with the highest log-likelihood (BIG-bench compares
  normalized log-probabilities; normalizing does not change which choice is highest).
- exact_str_match: the answer is cut after the task's stop_string and matched by its output_regex where the task sets
  them, cut at the first newline (lm-eval's stop), trimmed of surrounding whitespace, then compared with the targets.
"""

import re


def process_multiple_choice(doc, results):
    lls = [r[0] for r in results]
    best = max(range(len(lls)), key=lls.__getitem__)
    return {"multiple_choice_grade": float(doc["scores"][best])}


def postprocess(text, stop_string=None, output_regex=None):
    if stop_string:
        index = text.find(stop_string)
        if index > 0:
            text = text[: index + len(stop_string)]
    if output_regex:
        match = re.search(output_regex, text)
        text = match.group(0) if match else ""
    return text.split("\n", 1)[0].strip()


def process_generate(doc, results):
    answer = postprocess(results[0], doc.get("stop_string"), doc.get("output_regex"))
    return {"exact_str_match": float(answer in [t.strip() for t in doc["targets"]])}
