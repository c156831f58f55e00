#!/usr/bin/env bash
# graphmoe's decode beside llama.cpp's on the same model, in one command (from the repository root):
#
#   bash benchmarks/compare/llamacpp_decode.sh [BUILD_DIR]        # BUILD_DIR: default build-peer
#
# 1. llama.cpp's sources from PyPI's llama-cpp-python sdist (its vendor/llama.cpp; pip download
#    LLAMACPP_PY_SPEC, default llama-cpp-python==0.3.36), its CPU tools (llama-bench, llama-debug,
#    llama-simple) built with cmake: Release, -DGGML_NATIVE=ON, no GPU backend, no BLAS. Sources,
#    build and the converter's venv are cached under LLAMACPP_CACHE (~/.cache/graphmoe/llamacpp):
#    a rerun rebuilds nothing.
# 2. The model (benchmarks/compare/llamacpp_model.py, transformers' save_pretrained, float32): an
#    OlmoeForCausalLM at the olmoe preset's CPU benchmark shape (4 blocks, D = 256, 8 heads,
#    E = 64 experts of d_ff 128, top-8, vocabulary VOCAB = 10000 as bench_decode's olmoe cases),
#    random weights, with a byte-level BPE tokenizer.
# 3. llama.cpp's convert_hf_to_gguf.py (through llamacpp_convert.py: an unknown BPE pre-tokenizer
#    written as gpt-2) to f32 and bf16 GGUF files, in a venv of its own (venv-convert: the torch
#    venv's packages, scripts/install-torch-current.sh, plus sentencepiece and protobuf).
# 4. Agreement: llama-debug --save-logits on a fixed text prompt (f32 and bf16 GGUF) against
#    hf_decode --ids on the token ids llama.cpp used (the last position's logits), and llama-simple's
#    greedy continuation (text) against graphmoe's greedy ids turned into text by the tokenizer;
#    transformers' logits and greedy ids on the same ids against graphmoe's (the reference).
# 5. Decode tokens/s at batch 1, after prompts of 64 and 512 tokens, GEN (64) tokens, REPS (3)
#    repetitions after a warm-up, with 2 threads (the comparison; the target is read there) and
#    1 (THREADS: 2,1): llama-bench -p 0 -n GEN -d 64,512 -t 2,1 -r REPS -o json for the f32 and
#    the bf16 GGUF (llama.cpp's defaults otherwise: f16 KV cache, flash attention auto), and
#    benchmarks/hf_decode (graphmoe, float, hf::load_lm of the same directory; built into
#    BUILD_DIR, configured here if it is not) timed the same way. ROUNDS (3) rounds of the three,
#    interleaved; ratios are taken within a round. Each run records the load average and the
#    share of the machine's CPU time other processes took meanwhile (/proc/stat less the run's
#    own): on a busy machine llama.cpp's 2 threads lose far more than graphmoe's (ggml's threads
#    meet at a barrier after every op), so above 10% the report does not judge the target.
# 6. The report: OUT (benchmarks/results/decode/<today>-cpu-llamacpp.txt).
#
# Environment: PY (the torch venv's python, default ~/.cache/graphmoe/venv-torch/bin/python),
# LLAMACPP_CACHE, LLAMACPP_PY_SPEC, VOCAB, THREADS, GEN, REPS, ROUNDS, PROMPTS (64,512), OUT, JOBS
# (build parallelism, 2). OPENBLAS_CORETYPE: unset, unless scripts/openblas-coretype.sh says the
# CPU needs one (as the other comparison scripts).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
BUILD_DIR=${1:-build-peer}
PY=${PY:-$HOME/.cache/graphmoe/venv-torch/bin/python}
CACHE=${LLAMACPP_CACHE:-$HOME/.cache/graphmoe/llamacpp}
SPEC=${LLAMACPP_PY_SPEC:-llama-cpp-python==0.3.36}
VOCAB=${VOCAB:-10000}
THREADS=${THREADS:-2,1}
GEN=${GEN:-64}
REPS=${REPS:-3}
ROUNDS=${ROUNDS:-3}
PROMPTS=${PROMPTS:-64,512}
JOBS=${JOBS:-2}
OUT=${OUT:-benchmarks/results/decode/$(date +%Y-%m-%d)-cpu-llamacpp.txt}
COMMAND="bash benchmarks/compare/llamacpp_decode.sh $*"

die() { echo "llamacpp_decode: $*" >&2; exit 1; }
log() { echo "llamacpp_decode: $*" >&2; }
now() { date +%s.%N; }
PHASES=""
phase_done() { PHASES+="$1 $(awk -v a="$2" -v b="$(now)" 'BEGIN{printf "%.0f", b - a}') s; "; }

[[ -x "$PY" ]] || die "no $PY: bash scripts/install-torch-current.sh makes it"
unset OPENBLAS_CORETYPE
coretype=$(bash scripts/openblas-coretype.sh)
[[ -n "$coretype" ]] && export OPENBLAS_CORETYPE=$coretype && log "OPENBLAS_CORETYPE=$coretype"
mkdir -p "$CACHE/src"

# 1. sources and build -----------------------------------------------------------------------------
t=$(now)
pyver=${SPEC#*==}
sdist=$(ls "$CACHE"/src/llama_cpp_python-"$pyver".tar.gz 2>/dev/null | head -1 || true)
if [[ "$SPEC" != *==* || -z "$sdist" ]]; then
  # --no-binary for this package only: with :all: pip would also build the sdist's build
  # requirements (cmake, ...) from source to read its metadata
  "$PY" -m pip download "$SPEC" --no-binary llama-cpp-python --no-deps -d "$CACHE/src" >&2 \
    || die "pip download $SPEC failed"
  [[ "$SPEC" == *==* ]] || pyver=$(ls -t "$CACHE"/src/llama_cpp_python-*.tar.gz | head -1 | sed 's/.*llama_cpp_python-\(.*\)\.tar\.gz/\1/')
  sdist=$CACHE/src/llama_cpp_python-$pyver.tar.gz
fi
SRC=$CACHE/src/llama_cpp_python-$pyver/vendor/llama.cpp
[[ -f "$SRC/CMakeLists.txt" ]] || tar -xzf "$sdist" -C "$CACHE/src"
[[ -f "$SRC/convert_hf_to_gguf.py" ]] || die "$sdist has no vendor/llama.cpp"
LBUILD=$CACHE/build-$pyver
if [[ ! -f "$LBUILD/CMakeCache.txt" ]]; then
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  cmake -S "$SRC" -B "$LBUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_VULKAN=OFF -DGGML_METAL=OFF -DGGML_BLAS=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DBUILD_SHARED_LIBS=OFF >&2
fi
cmake --build "$LBUILD" -j"$JOBS" --target llama-bench llama-debug llama-simple >&2
BIN=$LBUILD/bin
phase_done "llama.cpp sources and build:" "$t"

# graphmoe's program
t=$(now)
if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DGRAPHMOE_ENABLE_CUDA=OFF \
    -DGRAPHMOE_BUILD_TESTS=OFF -DGRAPHMOE_BUILD_EXAMPLES=OFF -DGRAPHMOE_NATIVE=ON >&2
fi
cmake --build "$BUILD_DIR" -j"$JOBS" --target hf_decode >&2
HF_DECODE=$BUILD_DIR/benchmarks/hf_decode
phase_done "graphmoe hf_decode build:" "$t"

# 2. model, 3. conversion --------------------------------------------------------------------------
t=$(now)
VENV=$CACHE/venv-convert
if ! "$VENV/bin/python" -c 'import torch, transformers, sentencepiece, google.protobuf, yaml, tqdm, requests' 2>/dev/null; then
  rm -rf "$VENV"
  /usr/bin/python3 -m venv "$VENV" || die "python3 -m venv failed (Debian: python3-venv)"
  # the torch venv's packages (torch, transformers, numpy, ...) seen from this venv
  "$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
    >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/graphmoe-venv-torch.pth"
  "$VENV/bin/python" -m pip install -q "sentencepiece>=0.1.98,<0.3.0" "protobuf>=4.21.0,<5.0.0" \
    pyyaml tqdm requests >&2 || die "pip install of the converter's requirements failed"
fi
WORK=$CACHE/work-v$VOCAB
MODEL=$WORK/model
mkdir -p "$WORK"
if [[ ! -f "$MODEL/model.safetensors" ]]; then
  "$PY" benchmarks/compare/llamacpp_model.py "$MODEL" --vocab "$VOCAB" >&2
fi
phase_done "model:" "$t"
t=$(now)
for ty in f32 bf16; do
  if [[ ! -f "$WORK/olmoe-$ty.gguf" || "$WORK/olmoe-$ty.gguf" -ot "$MODEL/model.safetensors" ]]; then
    "$VENV/bin/python" benchmarks/compare/llamacpp_convert.py "$SRC" -- "$MODEL" --outtype "$ty" \
      --outfile "$WORK/olmoe-$ty.gguf.tmp" >"$WORK/convert-$ty.log" 2>&1 \
      || { tail -20 "$WORK/convert-$ty.log" >&2; die "convert_hf_to_gguf.py --outtype $ty failed"; }
    mv "$WORK/olmoe-$ty.gguf.tmp" "$WORK/olmoe-$ty.gguf"
  fi
done
phase_done "conversion (f32, bf16):" "$t"

# 4. agreement -------------------------------------------------------------------------------------
t=$(now)
AG=$WORK/agree
rm -rf "$AG"; mkdir -p "$AG"
PROMPT_TEXT="the graph of experts routes every token through what its neighbours chose before"
for ty in f32 bf16; do
  "$BIN/llama-debug" -m "$WORK/olmoe-$ty.gguf" -p "$PROMPT_TEXT" --save-logits \
    --logits-output-dir "$AG" -t "${THREADS%%,*}" -c 576 >"$AG/debug-$ty.log" 2>&1 \
    || { tail -20 "$AG/debug-$ty.log" >&2; die "llama-debug ($ty) failed"; }
  "$BIN/llama-simple" -m "$WORK/olmoe-$ty.gguf" -n 32 "$PROMPT_TEXT" \
    >"$AG/simple-$ty.out" 2>"$AG/simple-$ty.log" \
    || { tail -20 "$AG/simple-$ty.log" >&2; die "llama-simple ($ty) failed"; }
done
"$HF_DECODE" "$MODEL" --ids "$AG/llamacpp-olmoe-f32-tokens.bin" --logits-out "$AG/graphmoe.bin" \
  --greedy 32 --threads "${THREADS%%,*}" >"$AG/graphmoe.out"
phase_done "agreement:" "$t"

# 5. timing ----------------------------------------------------------------------------------------
t=$(now)
TM=$WORK/timing
rm -rf "$TM"; mkdir -p "$TM"
loadavg() { cut -d' ' -f1 /proc/loadavg; }
jiffies() { awk '/^cpu /{print $2 + $3 + $4 + $7 + $8 + $9, $2 + $3 + $4 + $5 + $6 + $7 + $8 + $9}' /proc/stat; }
for r in $(seq 1 "$ROUNDS"); do
  for side in graphmoe f32 bf16; do
    l0=$(loadavg); read -r b0 t0 < <(jiffies)
    if [[ $side == graphmoe ]]; then
      cmd=(); for th in ${THREADS//,/ }; do
        cmd+=("$HF_DECODE '$MODEL' --prompts $PROMPTS --gen $GEN --reps $REPS --threads $th;")
      done
      /usr/bin/time -f "%U %S" -o "$TM/$side-$r.cpu" sh -c "${cmd[*]}" >"$TM/$side-$r.out"
    else
      /usr/bin/time -f "%U %S" -o "$TM/$side-$r.cpu" "$BIN/llama-bench" -m "$WORK/olmoe-$side.gguf" \
        -p 0 -n "$GEN" -d "$PROMPTS" -t "$THREADS" -r "$REPS" -o json >"$TM/$side-$r.out" \
        2>"$TM/$side-$r.err" || { tail -20 "$TM/$side-$r.err" >&2; die "llama-bench ($side) failed"; }
    fi
    read -r b1 t1 < <(jiffies)
    # other processes' share of the machine's CPU time during the run: all busy time less ours
    others=$(awk -v b="$((b1 - b0))" -v t="$((t1 - t0))" -v own="$(awk '{print $1 + $2}' "$TM/$side-$r.cpu")" \
      'BEGIN { o = t > 0 ? (b / 100 - own) / (t / 100) * 100 : 0; printf "%.0f", o < 0 ? 0 : o }')
    echo "load $l0/$(loadavg) others ${others}%" >"$TM/$side-$r.load"
    log "round $r $side done: $(cat "$TM/$side-$r.load")"
  done
done
phase_done "timing:" "$t"

# 6. report ----------------------------------------------------------------------------------------
mkdir -p "$(dirname "$OUT")"
"$PY" benchmarks/compare/llamacpp_report.py --work "$WORK" --rounds "$ROUNDS" --prompts "$PROMPTS" \
  --gen "$GEN" --threads "$THREADS" --reps "$REPS" --sdist "$(basename "$sdist")" --src "$SRC" \
  --build-dir "$BUILD_DIR" --command "$COMMAND" --phases "$PHASES" \
  --openblas-coretype "${OPENBLAS_CORETYPE:-}" --prompt-text "$PROMPT_TEXT" >"$OUT"
cat "$OUT"
log "report: $OUT"
