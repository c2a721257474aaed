"""vLLM plugin: refuse a bad LoRA adapter with a 4xx and one line before vLLM's loader sees it.

Registered as the `lora_admission` entry point of `vllm.general_plugins` (pyproject.toml), so it runs in the API
server process of every vLLM the project starts. vLLM 0.32's POST /v1/load_lora_adapter answers a folder without
adapter weights, a rank above --max-lora-rank or an adapter of another base with 500 InternalServerError ("Call to
add_lora method failed: …"); wrapped here, `OpenAIServingModels.load_lora_adapter` first runs
scripts.levers.lora.adapters.adapter_problem against the served checkpoint and the server's max rank and answers 404/400 with
what is wrong. Adapters given at start (--lora-modules) pass through the same check. Nothing else changes: a good
adapter goes to vLLM's own loader.
"""

from __future__ import annotations

from pathlib import Path

_MARK = "_lab_lora_admission"


def error_response(message: str, status: int):
    """vLLM's own ErrorResponse, which its route turns into the HTTP status: vLLM 0.32 builds it with
    vllm.entrypoints.serve.create_error_response; vLLM 0.26 (the GPU bundle) has no such function, only the model."""
    from http import HTTPStatus

    err_type = "NotFoundError" if status == 404 else "BadRequestError"
    try:
        from vllm.entrypoints.serve import create_error_response
    except ImportError:
        from vllm.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse

        return ErrorResponse(error=ErrorInfo(message=message, type=err_type, code=status))
    return create_error_response(message=message, err_type=err_type, status_code=HTTPStatus(status))


def register() -> None:
    try:
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    except ImportError:  # a vLLM without this server module: nothing to wrap
        return
    if getattr(OpenAIServingModels, _MARK, False):
        return
    vllm_load = OpenAIServingModels.load_lora_adapter

    async def load_lora_adapter(self, request, base_model_name=None):
        from scripts.levers.lora.adapters import adapter_problem

        if request.lora_name and request.lora_path:
            lora_config = getattr(getattr(self.engine_client, "vllm_config", None), "lora_config", None)
            problem = adapter_problem(Path(request.lora_path), Path(self.model_config.model),
                                      getattr(lora_config, "max_lora_rank", None))
            if problem:
                status, message = problem
                return error_response(f"LoRA adapter {request.lora_name!r} refused: {message}", status)
        return await vllm_load(self, request, base_model_name)

    OpenAIServingModels.load_lora_adapter = load_lora_adapter
    setattr(OpenAIServingModels, _MARK, True)
