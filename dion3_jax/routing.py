# Copyright 2026 The dion3_jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""The name patterns of the default routing (:func:`dion3_jax.default_param_labels`).

Each is a regular expression matched, ignoring case, against every whole component of a leaf's
path (``re.fullmatch``); ``docs/ROUTING.md`` lists what each one matches. Pass an extended one
to :func:`dion3_jax.default_param_labels` (``scalar_pattern=``, ``vector_pattern=``,
``head_pattern=``) and that as ``param_labels=``, e.g. to send a ``mix`` vector to the scalar
optimizer::

    labels = lambda p: dion3_jax.default_param_labels(
        p, vector_pattern=routing.DEFAULT_VECTOR_PATTERN + "|mix")

Attributes:
  DEFAULT_SCALAR_PATTERN: embeddings (token or position) and output heads: the scalar
    optimizer.
  DEFAULT_VECTOR_PATTERN: per-feature parameters (biases, gains, norm layers, tokens, Mamba's
    ``A_log``): the scalar optimizer, at any rank, for the leaves a ``dimension_numbers`` tree
    does not declare. It holds no one-letter name: an undeclared leaf of rank ≥ 2 under ``b``,
    ``d`` or ``g`` is refused; add ``"|b"`` here to send such leaves to the scalar optimizer.
  DEFAULT_HEAD_PATTERN: output heads, also used to refuse trees of auto-named layers without
    a named head.
"""

from dion3_jax._routing import DEFAULT_HEAD_PATTERN, DEFAULT_SCALAR_PATTERN, DEFAULT_VECTOR_PATTERN

__all__ = (
    "DEFAULT_HEAD_PATTERN",
    "DEFAULT_SCALAR_PATTERN",
    "DEFAULT_VECTOR_PATTERN",
)
