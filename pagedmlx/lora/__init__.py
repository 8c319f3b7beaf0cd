"""Batched multi-LoRA (vLLM's vllm/lora/): mlx-lm LoRA and DoRA adapters served side by side, each
row of a step with its own adapter or none.

- request.py        LoRARequest (name, unique id, path), as vLLM's: what a request names
- models.py         LoRAModel: an mlx-lm adapter folder read and checked against the model
- layers.py         LinearWithLoRA: a targeted Linear with every resident adapter stacked per slot,
                    and PunicaWrapper: the step's per-row slots (the BGMV / SGMV gather products)
- model_manager.py  LoRAModelManager: the host cache of loaded adapters, the device slots, the step
"""

from pagedmlx.lora.request import LoRARequest

__all__ = ["LoRARequest"]
