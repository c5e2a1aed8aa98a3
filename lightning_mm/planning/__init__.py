"""``lightning-mm plan``: rank device meshes for a model by estimated memory and step time, before renting them.

Plain Python + torch (no Lightning import here; a reference preset imports :mod:`lightning_mm.models.vlm.model`
lazily, and an HF config is read as JSON, without ``transformers``). Every estimate is per rank (the busiest one:
pipeline stage 0 for activations, the largest stage for parameters) and per optimizer step.

**The model**, described by its shapes: a reference preset (``tiny | small | 1b``; parameter shapes from the real
module built on the meta device, the tensor-parallel plan from :func:`~lightning_mm.models.vlm.parallelize.
reference_vlm_plan`, the pipeline split from the model's own FLOP costs and
:func:`~lightning_mm.parallel.pipeline.auto_split`, as the strategy does) or a Hugging Face Llama-style decoder
(``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
``vocab_size``, ``tie_word_embeddings``; ``head_dim``, ``attention_bias``, ``mlp_bias`` when present; Qwen2's q/k/v
biases). The workload: tokens (and, for the VLM, image patches) per sample, one sample per row with no padding,
``micro_batch`` samples per forward on one data-parallel rank (one pipeline microbatch) and ``global_batch`` samples
per optimizer step (the rest is gradient accumulation, or pipeline microbatches when ``pp > 1``).

**Candidate meshes** ``pp x dp_replicate x dp_shard x tp`` (+ ``ep`` borrowed from dp_shard) whose product is the
device count and that the project accepts (:class:`~lightning_mm.parallel.dims.ParallelDims`, the strategy's and the
models' checks): ``tp`` divides every head count (and the KV heads); ``tp`` and ``ep`` groups stay inside a node
(:meth:`ParallelDims.check_nodes`); ``ep`` only for the reference VLM's experts, dividing dp_shard and the expert
count, and (as ``HybridParallelStrategy`` today) not combined with pp, tp or dp_replicate; ``pp`` at most the
number of layers (HF: decoder layers; reference VLM: its pipeline units, vision tower + decoder layers; a tied HF
embedding table is counted again on the last stage, which holds a copy); the global batch splits into whole
microbatches, at least ``pp`` of them under pipelining (1F1B). Each mesh is evaluated with and without activation
checkpointing (AC).

**Memory** (bytes of live tensors, the quantity ``benchmarks/plan_validation.py`` measures on CPU):

* parameters, gradients and AdamW state (two moments + a step scalar per tensor): fp32 master weights in both
  precisions (``32-true``, ``bf16-mixed``), sharded as the strategy shards them: tp-sharded dims divided by ``tp``
  (ceil), experts over ``ep``, then FSDP2 over dp_shard with its padding (``ceil(dim0 / dp_shard)`` rows);
* the batch, once per rank (every pipeline stage receives it from its DataLoader);
* FSDP2's unsharded parameters: the root unit (embeddings, heads, norms) stays gathered from forward to the end of
  backward; in a block's backward, that block's and the prefetched next block's parameters, then its unsharded
  gradients and the reduce-scatter buffer. Under pipeline parallelism the strategy keeps stages gathered
  (``reshard_after_forward=False``) and gradients unsharded until the last microbatch: the whole stage's;
* activations: what autograd saves for backward, counted per layer from the model's structure (eager PyTorch: every
  linear's input, LayerNorm / RMSNorm inputs, outputs and statistics, SDPA's q, k, v, output and log-sum-exp plus the
  float copy of a boolean mask, MLP intermediates, the modality experts' routed copies, the ``log_softmax`` of the
  loss in fp32); tensor parallel divides the per-head and MLP-hidden parts by ``tp``. With AC: every block's inputs,
  and in backward one block recomputed. 1F1B keeps ``min(pp - s, m)`` microbatches in flight on stage ``s``;
* pipeline buffers (``torch.distributed.pipelining``): receive buffers of every microbatch (one set per pass); the
  microbatches' outputs (the logits) and a forward-only pass's cache are released after each pass (a forward-only
  pass holds the sent outputs while it runs, the last stage one microbatch's logits: moments of their own below);
* the peak is the largest of: the end of forward (the previous step's gradients are still alive, since Lightning
  zeroes them between forward and backward, except under pipeline parallel; plus the logits), the start of backward
  (loss-gradient buffers), each block's backward in turn (its activations and FSDP2 buffers with the kept
  activations of the blocks before it and the gradients already produced; under 1F1B both the first backward, all
  microbatches in flight, and a later one, with the earlier microbatches' gradients), under pipeline parallel the end
  of a forward-only pass (the reference VLM's statistics pass; validation, for every model, with the last step's
  gradients alive: not validated on CPU) and the optimizer step (AdamW's foreach temporaries, one parameter-sized).
  ``bf16-mixed`` is modelled as FSDP2's bf16 parameter casting (2-byte activations, fp32 norm statistics and losses,
  fp32 reduction), and without FSDP as autocast (plus a bf16 copy of every matmul weight from its forward to its
  backward); it is not validated on CPU (``benchmarks/gpu_check.py`` compares it on a GPU).

**Bytes per step on each axis** (what a rank sends, averaged over ranks; ring algorithms: ``(n - 1) / n`` of the
buffer for all-gather and reduce-scatter, ``2 (n - 1) / n`` for all-reduce, the off-rank share for all-to-all, the
payload for a pipeline send), split intra-node / inter-node by whether the axis's groups stay inside a node:

* ``dp_shard``: FSDP2 all-gathers each block twice per micro-step (forward, and backward after resharding), the
  root once, in the compute dtype; one fp32 reduce-scatter of the gradients per micro-step. Under pipeline parallel
  once each per step. The reference VLM's expert units (``ep < dp_shard``) are gathered per call: twice per layer;
* ``dp_replicate``: HSDP's all-reduce of the reduce-scattered gradients;
* ``tp``: forward all-reduce after every row-parallel projection (attention output, MLP down), backward all-reduce of
  the input gradient of every column-parallel projection (q, k, v, MLP up / gate; the reference model's media keys
  and values too); the HF model's vocab-sharded embedding (forward all-reduce) and LM head (under loss parallel,
  which ``HFCausalLMModule`` runs pipelined or not: three fp32 all-reduces per token; else the logits all-gather;
  the input gradient's all-reduce); under sequence parallel (HF decoders) all-gathers and reduce-scatters instead
  of the all-reduces;
* ``pp``: the stage boundary tensors (forward) and their gradients (backward) per microbatch (under sequence
  parallel each tp rank's sequence shard), plus the reference VLM's forward-only statistics pass;
* ``ep``: dispatch and combine of every routed token in forward and backward (the last fusion layer's media output
  is unused, so its backward exchange never runs), ``1 - 1/ep`` of the tokens leave the rank on average.

Not modelled: the losses' bookkeeping collectives (under 1 KB per step), the reference VLM's sequence parallelism,
a first pipeline stage that holds no decoder layer (its boundary carries the whole sequence), CPU offload, LoRA,
padding inside batches, the allocator's caching and fragmentation (leave headroom: ``usable_memory_fraction``).

**Step time** = compute + exposed communication + pipeline bubble:

* compute: model FLOPs of the rank (forward x 3 for forward + backward, x 4 with AC, + one forward for the reference
  VLM's statistics pass under pp; tp-sharded matmuls divided by ``tp``, the rest replicated) / (peak FLOP/s x MFU);
* communication: each axis's bytes over the bandwidth of the link it uses (intra-node when its groups fit in a node,
  else inter-node). Overlap assumption: FSDP / HSDP traffic is prefetched behind compute and only what exceeds the
  compute time (at least one unit's share) is exposed; tensor-, expert- and pipeline-parallel traffic sits on the
  critical path and is fully exposed;
* bubble: ``(pp - 1) / (m + pp - 1)`` of the compute time (``m`` microbatches, 1F1B).

Candidates are ranked: those that fit in ``usable_memory_fraction x memory`` first, then by estimated step time.

**Modules**: :mod:`.hardware` (the machines), :mod:`.workload` (the batch, a rank's microbatches), :mod:`.mesh`
(a mesh and its axes), :mod:`.shapes` (what a model shape provides), :mod:`.vlm_shape` and :mod:`.hf_shape` (the
reference VLM, HF decoders), :mod:`.collectives` (ring formulas), :mod:`.memory` (bytes per stage),
:mod:`.estimates` (accepted meshes, traffic, time, :func:`evaluate`, :func:`plan`), :mod:`.cli` (``lightning-mm
plan``).
"""

from lightning_mm.planning.cli import build_parser, format_table, main, model_from_args
from lightning_mm.planning.collectives import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from lightning_mm.planning.estimates import Candidate, candidate_meshes, evaluate, plan
from lightning_mm.planning.hardware import GIB, Hardware
from lightning_mm.planning.hf_shape import CausalLMShape, load_hf_config
from lightning_mm.planning.mesh import AXES, MESH_ORDER, Mesh
from lightning_mm.planning.shapes import INDEX, STATS, ModelShape, ParamShape
from lightning_mm.planning.vlm_shape import VLMShape
from lightning_mm.planning.workload import Geometry, Workload

__all__ = [
    "AXES",
    "Candidate",
    "CausalLMShape",
    "GIB",
    "Geometry",
    "Hardware",
    "INDEX",
    "MESH_ORDER",
    "Mesh",
    "ModelShape",
    "ParamShape",
    "STATS",
    "VLMShape",
    "Workload",
    "build_parser",
    "candidate_meshes",
    "evaluate",
    "format_table",
    "load_hf_config",
    "main",
    "model_from_args",
    "plan",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
]
