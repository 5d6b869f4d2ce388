"""Oracle labels: the frozen base's KVzip (or KVzip+) scores of every training block, per layer,
KV head and token, computed once (``kvgate data oracle --config ...``) and read by the
training's oracle objective (``kvgate.recipes.oracle``).

- :mod:`.settings`: ``OracleLabels``, where the labels go and which KVzip computes them;
- :mod:`.identity`: what labels belong to (the base's weights, the blocks' tokens);
- :mod:`.store`: the folder (a JSON manifest and safetensors shards), atomic and resumable;
- :mod:`.compute`: the scores of each block through the ``kvzip`` policy's own passes (the
  command line, ``kvgate.cli.oracle``, runs ``label_data`` on a training config).
"""

from kvgate.data.oracle.identity import base_fingerprint, block_layout
from kvgate.data.oracle.settings import OracleError, OracleLabels, oracle_settings
from kvgate.data.oracle.store import LabelStore, load_labels

__all__ = ["LabelStore", "OracleError", "OracleLabels", "base_fingerprint", "block_layout",
           "load_labels", "oracle_settings"]
