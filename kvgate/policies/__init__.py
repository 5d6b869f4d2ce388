"""Eviction policies: one file each, one contract (``contract.Policy.keep`` -> [B, H_kv, n] mask,
extended by ``DecodeEvicting``, ``RowScoring``, ``StreamingPrefill``, ``EncodeMasking`` and
``PassScoring``).

``get_policy("snapkv", window=32)`` builds one by name; ``list_policies()`` lists the names;
``register_policy(name, cls)`` adds one from outside the package (``kvgate.policies.registry``).
"""

from kvgate.policies.adakv import AdaKV
from kvgate.policies.ahakv import AhaKV
from kvgate.policies.attention_gate import AttentionGatePolicy
from kvgate.policies.base import ScoredPolicy
from kvgate.policies.contract import (
    Budget,
    DecodeEvicting,
    EncodeMasking,
    LayerPrompt,
    PassScoring,
    Policy,
    PolicyError,
    RowScoring,
    StreamingPrefill,
)
from kvgate.policies.full import Full
from kvgate.policies.h2o import H2O
from kvgate.policies.knorm import KNorm
from kvgate.policies.kvzip import KVzip
from kvgate.policies.local_gate import LocalGatePolicy
from kvgate.policies.nacl import NaCl
from kvgate.policies.pyramidkv import PyramidKV
from kvgate.policies.random_keep import RandomKeep
from kvgate.policies.registry import (
    POLICIES,
    get_policy,
    list_policies,
    policy_class,
    register_policy,
)
from kvgate.policies.roco import RoCo
from kvgate.policies.snapkv import SnapKV
from kvgate.policies.streaming import Streaming
from kvgate.policies.tova import TOVA
from kvgate.policies.window import Window

__all__ = [
    "H2O",
    "POLICIES",
    "TOVA",
    "AdaKV",
    "AhaKV",
    "AttentionGatePolicy",
    "Budget",
    "DecodeEvicting",
    "EncodeMasking",
    "Full",
    "KNorm",
    "KVzip",
    "LayerPrompt",
    "LocalGatePolicy",
    "NaCl",
    "PassScoring",
    "Policy",
    "PolicyError",
    "PyramidKV",
    "RandomKeep",
    "RoCo",
    "RowScoring",
    "ScoredPolicy",
    "SnapKV",
    "Streaming",
    "StreamingPrefill",
    "Window",
    "get_policy",
    "list_policies",
    "policy_class",
    "register_policy",
]
