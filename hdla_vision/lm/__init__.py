"""Causal language models on the HDLA kernels (transformers ``model_type = "hdla"``).

Importing this package registers ``HDLAConfig`` with ``AutoConfig`` and the models with
``AutoModel`` / ``AutoModelForCausalLM``, and the causal mixers ``"hdla"``,
``"gated_deltanet"`` and ``"gated_deltaproduct"`` with the mixer registry.
"""
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_hdla import HDLAConfig
from .mixers import GatedDeltaNetMixer, GatedDeltaProductMixer, HDLAMixer, gated_deltaproduct_factors
from .cache import HDLACache
from .modeling_hdla import HDLAForCausalLM, HDLAModel, HDLAPreTrainedModel, split_packed

AutoConfig.register(HDLAConfig.model_type, HDLAConfig, exist_ok=True)
AutoModel.register(HDLAConfig, HDLAModel, exist_ok=True)
AutoModelForCausalLM.register(HDLAConfig, HDLAForCausalLM, exist_ok=True)

__all__ = [
    "HDLAConfig",
    "HDLACache",
    "HDLAPreTrainedModel",
    "HDLAModel",
    "HDLAForCausalLM",
    "HDLAMixer",
    "GatedDeltaNetMixer",
    "GatedDeltaProductMixer",
    "gated_deltaproduct_factors",
    "split_packed",
]
