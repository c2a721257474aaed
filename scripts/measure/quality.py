"""Task scores with the real lm-evaluation-harness against a variant's running vLLM server; writes a quality record.

    python -m scripts.measure.quality smollm2-bf16 --profile full --suite  # `make eval-quality-full`: BIG-bench Lite
    python -m scripts.measure.quality smollm2-bf16 --profile fast --suite  # `make eval-quality`: a 10% sample of it
    python -m scripts.measure.quality smollm2-bf16 --profile smoke       # a handful of items (`make eval-smoke`)
    python -m scripts.measure.quality qwen35-4b-awq-ref --profile full --base-url http://127.0.0.1:8000
    python -m scripts.measure.quality --download-datasets                # `make datasets-hub`: cache hub task data

Tasks come from --suite (the suite of record: BIG-bench Lite as drawn by scripts/data/bigbench_tasks.py, after
`make datasets`), else --tasks, else the variant's EVAL_TASKS, else MMLU-Pro, IFEval and GPQA-Diamond. BIG-bench
items and log-likelihood tasks go through `local-completions` in their own prompt format (no chat template); for a
GGUF served by llama.cpp, generation goes to its server as text and log-likelihoods come from llama.cpp in-process
(`scripts.levers.gguf.logits score`: the same GGUF, threads and kernels; its server's echo + logprobs sorts the whole
vocabulary in Python for every prompt token: its first 6 requests of the suite took 4 min 22 s); the other generation tasks through
`local-chat-completions` (the server applies the chat template; thinking options are the server's
SERVE_DEFAULT_CHAT_TEMPLATE_KWARGS). Profiles set the sample size: smoke = 5 items per task, fast = 10% of each task,
full = everything. Writes experiments/<variant>/quality_<YYYYMMDD-HHMMSS>.json only when the whole evaluation
succeeded; a suite record carries the suite's name, hashes and pooled score.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import ENGINES, EngineError
from scripts.common.gate import main_metric
from scripts.common.records import envelope, save_record
from scripts.common.server import ServerError, http_post_json, is_healthy
from scripts.common.variants import VariantError, load_variant
from scripts.data.bigbench import BigBenchError
from scripts.data.bigbench_tasks import SUITE, TASK_PREFIX, suite_manifest, suite_tasks
from scripts.data.corpus import dataset_cached
from scripts.levers.gguf import logits as llamacpp_logits
from scripts.serve.command import llamaserver_defaults
from scripts.serve.launch import variant_server

DEFAULT_TASKS = ("mmlu_pro", "ifeval", "gpqa_diamond_cot_zeroshot")
# task -> (HF dataset, config): what `make datasets-hub` caches. GPQA is gated on the hub: accept its terms, set HF_TOKEN.
TASK_DATASETS = {
    "mmlu_pro": ("TIGER-Lab/MMLU-Pro", None),
    "ifeval": ("google/IFEval", None),
    "gpqa_diamond_cot_zeroshot": ("Idavidrein/gpqa", "gpqa_diamond"),
}
CORPUS_DATASETS = {"wikitext2": ("wikitext", "wikitext-2-raw-v1")}
LOGLIKELIHOOD_TASKS = {"lab_arith_mc"}  # need prompt logprobs: local-completions
PLUMBING_TAG = "lab_"
PROFILES = {"smoke": 5, "fast": 0.1, "full": None}


class EvalError(RuntimeError):
    pass


def missing_datasets(tasks: list[str]) -> list[str]:
    """Known task datasets that are not in the local HF datasets cache."""
    return [f"{t} needs {TASK_DATASETS[t][0]}{'/' + TASK_DATASETS[t][1] if TASK_DATASETS[t][1] else ''}"
            for t in tasks if t in TASK_DATASETS and not dataset_cached(*TASK_DATASETS[t])]


def download_datasets() -> int:
    import datasets

    failures = []
    for what, (path, name) in {**TASK_DATASETS, **CORPUS_DATASETS}.items():
        try:
            datasets.load_dataset(path, name)
            print(f"cached {path} ({what})")
        except Exception as e:  # noqa: BLE001
            failures.append(f"{path}{'/' + name if name else ''} for {what}: {type(e).__name__}")
    for f in failures:
        print(f"error: cannot download {f}; run where the Hugging Face hub is reachable (GPQA is gated: accept its "
              f"terms on the hub and export HF_TOKEN)", file=sys.stderr)
    return 1 if failures else 0


def lm_eval_run(model, model_args: dict, tasks: list[str], limit, chat: bool) -> dict:
    """lm-eval's simple_evaluate on a model type (str) with its arguments, or on a model instance."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model, model_args=model_args if isinstance(model, str) else None, tasks=tasks, limit=limit, log_samples=True,
        apply_chat_template=chat, task_manager=TaskManager(include_path=str(paths.EVAL / "tasks")),
        bootstrap_iters=1000,
    )


ITEM_ID_FIELDS = ("id", "key", "question_id")  # a dataset's own stable id, where it has one


def item_id(sample: dict) -> str:
    """A stable id of one lm-eval item: the dataset's own id field, else the hash lm-eval takes of the document."""
    doc = sample.get("doc") or {}
    own = next((doc[f] for f in ITEM_ID_FIELDS if isinstance(doc.get(f), (str, int))), None)
    return str(own) if own is not None else sample["doc_hash"]


def scores(results: dict) -> tuple[dict, dict, list]:
    """lm-eval's results → ({task: {metric: value, metric_stderr: se, n: samples}}, {task: version, item-set hash,
    main metric}, per-item samples keyed by a stable item id with the main metric's score)."""
    summary, meta, samples = {}, {}, []
    for task, metrics in results["results"].items():
        entry = {}
        for key, value in metrics.items():
            if "," not in key or not isinstance(value, (int, float)):
                continue
            metric, _filter = key.split(",", 1)
            entry[metric] = value if value == value else None  # NaN -> None
        entry["n"] = results.get("n-samples", {}).get(task, {}).get("effective")
        summary[task] = entry
    for task, items in results.get("samples", {}).items():
        metric = main_metric(summary[task])
        ids = []
        for it in items:
            iid = item_id(it)
            ids.append(f"{iid}:{it.get('doc_hash')}")
            samples.append({"task": task, "doc_id": it.get("doc_id"), "item_id": iid, "doc_hash": it.get("doc_hash"),
                            "score": float(it[metric]) if metric in it else None,
                            "target": str(it.get("target"))[:200], "response": str(it.get("filtered_resps"))[:200],
                            "metrics": {m: it[m] for m in it.get("metrics", []) if m in it}})
        if len(set(ids)) != len(ids):
            raise EvalError(f"{task}: item ids are not unique; the gate could not pair its items")
        meta[task] = {"version": str(results.get("versions", {}).get(task)), "metric": metric, "n": len(ids),
                      "items_sha256": hashlib.sha256("\n".join(sorted(ids)).encode()).hexdigest()}
    return summary, meta, samples


def loglikelihood_task(task: str) -> bool:
    """Scored by the log-likelihood of its choices: needs the prompt tokens' log-probabilities from the server."""
    if task.startswith(TASK_PREFIX):
        return suite_manifest()["tasks"][task[len(TASK_PREFIX):]]["kind"] == "multiple_choice"
    return task in LOGLIKELIHOOD_TASKS


def prompt_logprobs_problem(status: int, body: dict | None) -> str | None:
    """None when a completions answer (echo + logprobs) carries the prompt tokens' log-probabilities; else why not."""
    if status != 200 or not isinstance(body, dict):
        return f"its /v1/completions answered HTTP {status} to echo + logprobs"
    logprobs = ((body.get("choices") or [{}])[0] or {}).get("logprobs") or {}
    if sum(v is not None for v in logprobs.get("token_logprobs") or []) < 2:
        return "its /v1/completions answer to echo + logprobs holds no log-probabilities of the prompt tokens"
    return None


def split_loglikelihood(tasks: list[str], base_url: str, model: str) -> tuple[list[str], dict | None]:
    """(the tasks this server can score, what was skipped and why): an engine without prompt log-probabilities keeps
    the generative tasks, says so and records it; with nothing left to score it is an error, never an empty record."""
    ll = [t for t in tasks if loglikelihood_task(t)]
    if not ll:
        return tasks, None
    status, body = http_post_json(f"{base_url}/v1/completions", {
        "model": model, "prompt": "Q: 1 + 1 =\nA: 2", "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0})
    if status in (401, 403):  # the server is keyed (or another one answers): scoring nothing is no subset
        raise EvalError(f"{base_url}/v1/completions answered HTTP {status}: the server refuses this client (an API key "
                        f"it was started with, or another server on its port); nothing was scored")
    why = prompt_logprobs_problem(status, body)
    if why is None:
        return tasks, None
    kept = [t for t in tasks if t not in ll]
    if not kept:
        raise EvalError(f"the server cannot score multiple-choice tasks ({why}) and no generative task is left")
    print(f"warning: the server cannot score the {len(ll)} multiple-choice task(s) ({why}); scoring the generative "
          f"subset only ({len(kept)} task(s)); the record names what was skipped", file=sys.stderr)
    return kept, {"tasks": ll, "why": why}


def llamacpp_loglikelihoods(gguf: str, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """(log-likelihood of the continuation, greedy?) per (context ids, continuation ids), from llama.cpp in-process."""
    paths.CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="loglikelihood-llamacpp-", dir=paths.CACHE) as tmp:
        requests, out = Path(tmp) / "requests.json", Path(tmp) / "scores.json"
        requests.write_text(json.dumps(pairs))
        try:
            llamacpp_logits.run(["score", gguf, str(requests), str(out)])
        except EngineError as e:
            raise EvalError(f"log-likelihoods of {gguf}: {e}") from None
        return [(float(lp), bool(greedy)) for lp, greedy in json.loads(out.read_text())]


def llamacpp_model(args: dict, gguf: str):
    """lm-eval's local-completions model against llama.cpp's server, its log-likelihoods from llama.cpp in-process."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    class LlamaCppCompletions(LocalCompletionsAPI):
        def _loglikelihood_tokens(self, requests, **kwargs):
            return llamacpp_loglikelihoods(gguf, [(list(ctx), list(cont)) for _, ctx, cont in requests])

    return LlamaCppCompletions(**args)


def completion_task(task: str) -> bool:
    """Scored in the task's own prompt format through /v1/completions: log-likelihood tasks and BIG-bench items."""
    return task in LOGLIKELIHOOD_TASKS or task.startswith(TASK_PREFIX)


def context_tokens(variant) -> int:
    """The context one request may use: vLLM's max model length, llama-cpp-python's n_ctx, llama-server's ctx-size
    per slot (the server shares it among its --parallel slots), else 2048."""
    r = variant.resolved
    if variant.engine == "llamaserver":
        own = variant.engine_settings()
        slots = int(own.get("PARALLEL", 1))
        return int(own.get("CTX_SIZE", llamaserver_defaults(own)["ctx-size"])) // slots
    return int(r.get("LLAMACPP_N_CTX" if variant.engine == "llamacpp" else "SERVE_MAX_MODEL_LEN", 2048))


def evaluate(variant, base_url: str, tasks: list[str], limit) -> tuple[dict, dict, list]:
    served = variant.served_name
    tokenizer = paths.resolve_model(variant.resolved.get("TOKENIZER", variant.resolved["MODEL"]))
    # every request the server can batch in flight at once (vLLM's max_num_seqs; llama.cpp queues them)
    common = {"model": served, "num_concurrent": variant.max_num_seqs, "max_retries": 2, "timeout": 600}
    max_gen = variant.resolved.get("EVAL_MAX_GEN_TOKS")
    if max_gen:
        common["max_gen_toks"] = int(max_gen)
    llamacpp = ENGINES[variant.engine].gguf  # llama-cpp-python's server or llama-server
    context = context_tokens(variant)
    completions = {**common, "base_url": f"{base_url}/v1/completions", "tokenizer_backend": "huggingface",
                   "tokenizer": tokenizer, "max_length": int(context),
                   # llama.cpp's servers take text prompts only
                   **({"tokenized_requests": False} if llamacpp else {})}
    runs = [  # (lm-eval model type or instance, its tasks, its arguments, chat template)
        (llamacpp_model(completions, variant.model) if llamacpp else "local-completions",
         [t for t in tasks if completion_task(t)], completions, False),
        ("local-chat-completions", [t for t in tasks if not completion_task(t)],
         {**common, "base_url": f"{base_url}/v1/chat/completions", "tokenizer_backend": "none",
          "tokenized_requests": False}, True),
    ]
    summary, meta, samples = {}, {}, []
    for model, group, args, chat in runs:
        if group:
            s, m, x = scores(lm_eval_run(model, args, group, limit, chat=chat))
            summary.update(s)
            meta.update(m)
            samples += x
    return summary, meta, samples


def suite_inputs() -> dict:
    """The suite of record as a record names it: lm-eval tasks, item count and hashes of the drawn items and sdist."""
    m = suite_manifest()
    return {"name": SUITE, "tasks": suite_tasks(), "items": m["items"], "sha256": m["sha256"],
            "sdist": m["sdist"], "sdist_sha256": m["sdist_sha256"], "draw": m["draw"]}


def suite_summary(samples: list[dict]) -> dict:
    """The pooled score: the mean of every item's score, each item weighing the same."""
    scored = [s["score"] for s in samples if s["score"] is not None]
    return {"items": len(scored), "score": sum(scored) / len(scored) if scored else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", nargs="?", default=paths.DEFAULT_VARIANT)
    p.add_argument("--profile", choices=sorted(PROFILES), default="fast")
    p.add_argument("--suite", action="store_true", help="the suite of record: BIG-bench Lite (make datasets)")
    p.add_argument("--tasks", help="comma-separated lm-eval tasks (default: the variant's EVAL_TASKS, else "
                                   + ",".join(DEFAULT_TASKS) + ")")
    p.add_argument("--limit", type=float, help="override the profile's sample size (int: items, <1: fraction)")
    p.add_argument("--base-url", help="evaluate a running server instead of starting one")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--download-datasets", action="store_true", help="cache every task dataset, then exit")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.download_datasets:
        return download_datasets()
    try:
        variant = load_variant(args.variant)
        if variant.is_shape_proxy:
            raise EvalError(f"{variant.name} is a shape proxy (random weights): quality is never measured on it")
        suite = suite_inputs() if args.suite else None
        tasks = suite["tasks"] if suite else [
            t for t in (args.tasks or variant.resolved.get("EVAL_TASKS") or ",".join(DEFAULT_TASKS)).split(",") if t]
        if missing := missing_datasets(tasks):
            raise EvalError(f"task data not cached: {'; '.join(missing)}. Run `make datasets-hub` where the hub is "
                            f"reachable, or pick offline tasks (--tasks lab_arith_mc,lab_arith_gen,lab_ifeval)")
        limit = args.limit if args.limit is not None else PROFILES[args.profile]
        if isinstance(limit, float) and limit >= 1:
            limit = int(limit)
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="eval") as (base_url, server):
            record = envelope("quality", variant, command=[sys.executable, "-m", "scripts.measure.quality", *sys.argv[1:]],
                              server_command=server.argv if server else None)
            t0 = time.monotonic()
            llamacpp = ENGINES[variant.engine].gguf  # checked by variant_server
            # a GGUF's log-likelihoods come from llama.cpp in-process, not from its server
            tasks, skipped = (tasks, None) if llamacpp else split_loglikelihood(tasks, base_url, variant.served_name)
            summary, meta, samples, failure = {}, {}, [], None
            try:
                summary, meta, samples = evaluate(variant, base_url, tasks, limit)
            except Exception as e:  # noqa: BLE001 - lm-eval raises many types; the run failed as a whole
                healthy = is_healthy(base_url)
                failure = (f"lm-eval failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
                           + ("" if healthy else "; the server is no longer healthy"))
    except (EvalError, VariantError, ServerError, CheckpointError, BigBenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    import lm_eval

    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["inputs"] = {"kind": "lm-eval", "tasks": tasks, "profile": args.profile, "limit": limit,
                        "plumbing": all(t.startswith(PLUMBING_TAG) for t in tasks), "lm_eval": lm_eval.__version__,
                        "task_meta": meta,
                        "base_url": base_url, "offline": os.environ.get("HF_DATASETS_OFFLINE") == "1",
                        "loglikelihoods": "llama.cpp in-process (scripts.levers.gguf.logits score)" if llamacpp
                        else "the server's /v1/completions (echo + logprobs)",
                        **({"skipped": skipped} if skipped else {})}
    if failure:  # recorded as failed (no scores), so a killed server leaves a record that says so
        record["status"], record["failure"] = "failed", failure
        if (path := save_record(record, args.out_dir or variant.path, "quality")) is not None:
            print(f"wrote {paths.shown(path)} (status failed)")
        print(f"error: {failure}", file=sys.stderr)
        return 1
    if suite:
        record["inputs"]["suite"] = {k: v for k, v in suite.items() if k != "tasks"}
        if limit is not None:  # lm-eval takes the first `limit` of each task's items: the same sample every run
            record["inputs"]["suite"]["sample"] = {"limit": limit, "stratified_by": "task", "items": len(samples)}
        summary_suite = suite_summary(samples)
    record["summary"] = {"tasks": summary, **({"suite": summary_suite} if suite else {})}
    record["samples"] = samples
    if (path := save_record(record, args.out_dir or variant.path, "quality")) is None:
        return 1
    for task, m in summary.items():
        shown = ", ".join(f"{k} {v:.3f}" for k, v in m.items() if isinstance(v, float) and not k.endswith("_stderr"))
        print(f"{task}: {shown} (n={m.get('n')})")
    if suite:
        print(f"{suite['name']}: pooled {summary_suite['score']:.4f} over {summary_suite['items']} items")
    print(f"wrote {paths.shown(path)}" + ("  [plumbing tasks: not a benchmark]" if record["inputs"]["plumbing"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
