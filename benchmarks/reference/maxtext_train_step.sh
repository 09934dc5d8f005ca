#!/usr/bin/env bash
# Rebuilds maxtext-0.2.5_qwen2.5-3b_v5p-2x4x4.hlo.gz: MaxText's train step for Qwen2.5-3B's dimensions, compiled
# for v5p:2x4x4 by the compiler pacs-jax uses (jax/jaxlib 0.10.2, libtpu 0.0.42.1), the shapes of
# configs/qwen3b_v5p.py: mesh fsdp 16 x tensor 2, 2,048 rows x 4,608 tokens as 32 micro-batches of 64 rows,
# bf16 compute, fp32 weights, splash attention, remat `minimal_with_context`.
#
#   bash benchmarks/reference/maxtext_train_step.sh [python3.12] [workdir]     (about 10 minutes, CPU only)
#
# MaxText 0.2.5 needs Python >= 3.12 and a newer jax than 0.10.2 for one GPU-only import
# (`jax.experimental.xla_metadata.must_fuse_call`, in its jax flash-attention kernel): the script installs
# the pinned compiler and stubs that one name. Its cost analysis is printed; the compiled HLO is written.
set -euo pipefail
PY=${1:-python3.12}
WORK=${2:-/tmp/maxtext_reference}
OUT="$(cd "$(dirname "$0")" && pwd)/maxtext-0.2.5_qwen2.5-3b_v5p-2x4x4.hlo.gz"
mkdir -p "$WORK"
"$PY" -m venv "$WORK/venv"
. "$WORK/venv/bin/activate"
pip install -q "flax==0.12.8" "optax==0.2.8" "orbax-checkpoint==0.12.8" omegaconf pydantic absl-py ml-collections \
  tensorboardx jaxtyping einshape aqtp grain etils gcsfs google-cloud-storage qwix tokamax
pip install -q --no-deps "maxtext==0.2.5" "jax==0.10.2" "jaxlib==0.10.2" "libtpu==0.0.42.1" pathwaysutils fastapi \
  starlette annotated_doc anyio uvicorn click jinja2 huggingface_hub transformers regex httpx2 filelock httpcore2 \
  truststore h11 safetensors tokenizers hf-xet tqdm packaging pyyaml requests urllib3 idna certifi \
  charset-normalizer typing-inspection drjax pillow tiktoken sentencepiece sympy mpmath
SITE=$(python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
sed -i 's/^from jax.experimental.xla_metadata import must_fuse_call$/must_fuse_call = lambda *a, **k: (lambda f: f)/' \
  "$SITE/maxtext/kernels/attention/jax_flash_attention.py"
cd "$WORK"
rm -rf dump
JAX_PLATFORMS=cpu XLA_FLAGS="--xla_dump_to=$WORK/dump --xla_dump_hlo_module_re=jit_train_step" \
python -m maxtext.trainers.pre_train.train_compile "$SITE/maxtext/configs/base.yml" \
  compile_topology=v5p-64 compile_topology_num_slices=1 model_name=qwen2.5-7b override_model_config=true \
  base_emb_dim=2048 base_num_query_heads=16 base_num_kv_heads=2 base_mlp_dim=11008 base_num_decoder_layers=36 \
  vocab_size=151936 logits_via_embedding=true per_device_batch_size=2 gradient_accumulation_steps=32 \
  max_target_length=4608 attention=flash remat_policy=minimal_with_context ici_fsdp_parallelism=16 \
  ici_tensor_parallelism=2 dataset_type=synthetic enable_checkpointing=false run_name=reference \
  base_output_directory="$WORK/out" > "$WORK/compile.log" 2>&1
gzip -9 -c "$(ls "$WORK"/dump/*jit_train_step*.after_codegen.txt | head -1)" > "$OUT"  # with the cost model's cycles
# Its cost analysis beside it: XLA's optimal_seconds (each loop body once), flops, bytes accessed, memory.
python - "$WORK/compile.log" "${OUT%.hlo.gz}.json" <<'PY'
import ast, json, re, sys
log = open(sys.argv[1]).read()
cost = ast.literal_eval(re.search(r"Cost analysis: (\{.*\})", log).group(1))
memory = dict(kv.split("=") for kv in re.search(r"Memory analysis: CompiledMemoryStats\((.*)\)", log).group(1).split(", "))
json.dump({"program": "MaxText 0.2.5 train step, Qwen2.5-3B dimensions, v5p:2x4x4 (fsdp 16 x tensor 2), 32 "
                      "micro-batches of 64 rows x 4608 tokens, splash, remat minimal_with_context",
           "compiler": "jax/jaxlib 0.10.2, libtpu 0.0.42.1", "made_by": "benchmarks/reference/maxtext_train_step.sh",
           **{k: cost[k] for k in ("optimal_seconds", "flops", "bytes accessed", "transcendentals")},
           "memory": {k: int(memory[k]) for k in ("argument_size_in_bytes", "output_size_in_bytes",
                                                  "alias_size_in_bytes", "temp_size_in_bytes")}},
          open(sys.argv[2], "w"), indent=1)
PY
echo "wrote $OUT and ${OUT%.hlo.gz}.json"
