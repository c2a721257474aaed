"""vLLM model plugin: Gemma 3 as an EAGLE-3 target.

vLLM's Gemma3ForCausalLM (0.26 on the GPU machine, 0.32 on CPU) does not implement SupportsEagle3: it cannot hand an
EAGLE-3 head the hidden states of its auxiliary layers. `Gemma3Eagle3ForCausalLM` is that model with one change, the
one vLLM's Llama makes: once the runner names auxiliary layers (set_aux_hidden_state_layers), forward also returns
the residual stream at each of them (hidden_states + residual, EagleModelMixin._maybe_add_hidden_state; id L is the
output of decoder layer L-1, as in vLLM's Llama and in transformers' hidden_states[L]). Without auxiliary layers it
returns what Gemma3ForCausalLM returns, and the weights load the same way. One pipeline stage only.

A variant selects it with `SERVE_HF_OVERRIDES={"architectures": ["Gemma3Eagle3ForCausalLM"]}`; registered through
this project's `vllm.general_plugins` entry point (pyproject.toml), lazily, like scripts.levers.vocab.plugin.
"""

from __future__ import annotations

ARCH = "Gemma3Eagle3ForCausalLM"


def register() -> None:
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, f"scripts.levers.speculate.targets:{ARCH}")


def __getattr__(name: str):
    """The model class is built on first use: importing vLLM's Gemma 3 belongs in the engine's process only."""
    if name != ARCH:
        raise AttributeError(name)
    from itertools import islice

    from vllm.distributed import get_pp_group
    from vllm.model_executor.models import gemma3
    from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM, Gemma3Model
    from vllm.model_executor.models.interfaces import EagleModelMixin, SupportsEagle3

    class Gemma3AuxModel(Gemma3Model, EagleModelMixin):
        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs):
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual, aux = None, []
            aux = self._maybe_add_hidden_state(aux, self.start_layer, hidden_states, residual)
            for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
                hidden_states, residual = layer(positions, hidden_states, residual, **kwargs)
                aux = self._maybe_add_hidden_state(aux, idx + 1, hidden_states, residual)
            hidden_states, _ = self.norm(hidden_states, residual)
            return (hidden_states, aux) if aux else hidden_states

    class Gemma3Eagle3ForCausalLM(Gemma3ForCausalLM, SupportsEagle3):
        def __init__(self, *, vllm_config, prefix: str = ""):
            if get_pp_group().world_size > 1:
                raise NotImplementedError(f"{ARCH} runs as one pipeline stage")
            # Gemma3ForCausalLM builds its decoder by the module's name Gemma3Model: it is the subclass while this
            # __init__ runs. (Swapping the class of the built decoder is not enough: vLLM's compile wrapper has
            # already bound the original forward.)
            gemma3.Gemma3Model = Gemma3AuxModel
            try:
                super().__init__(vllm_config=vllm_config, prefix=prefix)
            finally:
                gemma3.Gemma3Model = Gemma3Model

    globals()[ARCH] = Gemma3Eagle3ForCausalLM
    return Gemma3Eagle3ForCausalLM
