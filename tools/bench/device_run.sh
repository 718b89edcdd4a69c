#!/usr/bin/env bash
# The GPU machine's whole build-check-measure cycle (python3 + torch + CUDA, no network).
# Every result goes under $OUT (default ./device-out). ftkit is installed editable from this tree
# without build isolation or deps; the CPU kernel is built with a plain g++ call.
#   OUT=/tmp/out PARTS="kernels calibrate gpu read decode" bash tools/bench/device_run.sh
# PROFILE: the profile the parts price bounds with (default the committed H200 one; the calibrate
# part replaces it with its own, so a later run in the same call can name that file).
# Parts: kernels (build, check, CPU bandwidth at 1..16 threads, a CPU decode step's attention), calibrate (profile; CAL_MODEL=q12 or
# q4km: of that model's slot formats), wrong
# (wrong-profile convergence), gpu (the CUDA tests; GPU_TESTS: other test files, GPU_K: a -k expression), zerocopy
# (decode fills vs DMA; ZC_FLAGS: its flags), read (FTW read + pin), decode (qwen3-30b-a3b shape cut to 12 layers:
# decode per strategy, graphs off and on, beside the bounds; DECODE_MODEL q12 or q4km,
# CACHE_FRACTION, DECODE_FLAGS: more ft-bench flags, for it and the ab part's decode), prefill (4096- and 8192-token
# chunks beside the PCIe bound, layer streaming on and off, each followed by a 32-token answer
# and a 32-token extend), extend (an agent turn with concentrated synthetic routing, reuse 0.9:
# 32 decode steps, an 8192-token chunk, a 32-token answer, the 32-token extend;
# EXTEND_STRATEGIES, REPEAT turns, GRAPHS), ab (for each tree of AB in turn, alternated on one
# machine, in the environment AB_ENV_<name> adds, each run of AB_RUN: extend, that extend with
# AB_STRATEGIES (default hybrid); decode, graph decode with AB_STRATEGIES (THREADS, default
# 15); bigprompt, the bigprompt part at the first of PREFILL_CHUNKS with AB_STRATEGIES;
# nextdecode, the nextdecode part's graph decode with AB_STRATEGIES; nextprefill, the
# nextprefill part's prompt with anchors every ANCHORS tokens (default none); zerocopy, the fills
# bench; cpubw, the CPU kernel at CPU_TOKENS; plan, the planning kernels against the cache's size), sampled (hybrid decode
# as above, each token sampled on the device at temperature 0.7, top-p 0.95), attn (a chunk's
# attention behind cached keys: flash against the masked kernel), gemm (prefill's grouped expert
# GEMM alone at gpt-oss-20b's and qwen3-30b-a3b's shapes, each of GEMM_FORMATS), dense (a decode step's small
# launches timed one by one inside a CUDA graph: cuBLAS against the Triton GEMV), cpubw (the
# CPU kernel's GB/s at 15 threads at each of CPU_SHAPES), hostmem (HOSTMEM_MODEL's loaded pool: read rate per GiB and where its
# pages are), longctx (graph decode behind PROMPTS-token prompts), bigprompt (a LONG_CHUNK-token
# prompt prefilled layer by layer in pieces of each of PREFILL_CHUNKS tokens, then a 32-token
# extend; REPEAT turns), nextdecode (qwen3-next-80b-a3b cut to 4 layers: decode per strategy,
# graphs off and on), nextprefill (the same model: a LONG_CHUNK-token prompt without and with
# an anchor every ANCHORS tokens; REPEAT turns), serve (ft-run serve driven through the openai SDK,
# beside the engine's own figures: ft-bench serve on SERVE_MODEL, q12 or q4km; SERVE_CACHE, SERVE_FLAGS,
# SERVE_TAG names the outputs), llamacpp (llama.cpp beside ftkit on one Q4_K_M file: llama.cpp's
# source carried as .llama/llama-src.tgz (tools/bench/llama_source.sh), built for CUDA; the q12
# shape written as a bf16 GGUF, quantized by llama-quantize, converted by ftw-convert; llama-bench
# at LLAMA_NCMOE layers' experts on the CPU (default "8 12": a third of the experts on the GPU,
# then none) and ft-bench decode of the same file, uniform and real routing, at CACHE_FRACTION;
# prompts of 512 and 4096 tokens in both; tests/test_llama_quantize.py with that llama-quantize
# first; with the calibrate part it took 417 s of a call's 600 on an H100 host, the build and
# the files most of it: they stay in WORK while the machine is warm, so a call stopped by its
# limit goes on from them in the next; CAL_MODEL=lq4km calibrates on that file).
# Everything ends up in $OUT/results.tgz (the GPU machine hands back few files); the tables
# also go to stdout.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}
PY=${PYTHON:-python3}
PARTS=${PARTS:-kernels calibrate gpu read decode}
W=${WORK:-${TMPDIR:-/tmp}/ftkit-bench}
mkdir -p "$OUT" "$W"
export PYTHONUNBUFFERED=1
pack() {  # also when stopped by a timeout: what was measured so far comes back
  trap - EXIT TERM
  cd "$OUT" && tar czf /tmp/results.tgz --exclude results.tgz . && mv /tmp/results.tgz . && find . -mindepth 1 ! -name results.tgz -delete
}
trap pack EXIT
trap 'exit 143' TERM
has() { [[ " $PARTS " == *" $1 "* ]]; }
if ! $PY -c "import ftkit.kernels.cpu" 2>/dev/null; then
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e .
fi
{ nproc; lscpu | grep -E 'Model name|^L3|NUMA|Socket|Core|Thread'; grep -H . /sys/kernel/mm/transparent_hugepage/{enabled,defrag}
  grep -E 'MemTotal|MemFree|MemAvailable|^Cached|AnonHuge|HugePages_Total' /proc/meminfo; numactl -H 2>/dev/null; nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv; } > "$OUT/machine.txt" 2>&1
PROFILE=${PROFILE:-docs/profiles/h200-16c.json}
# ft-bench's results file: --out (a tree older than that option took the path as --json; the ab
# part sets J again for each tree it installs)
# (the help read whole first: under pipefail, `grep -q` closing the pipe early made the check
# fail at random, and one A/B run was lost to an unknown --json)
bench_json_flag() { local help; help=$(COLUMNS=200 $PY -m ftkit.tools.bench.cli decode --help 2>/dev/null)
  grep -qE -- '--out +-o' <<< "$help" && echo --out || echo --json; }
J=$(bench_json_flag)
if has kernels; then
  $PY -c "from ftkit.kernels.cpu import load; k = load(); print('kernel:', k.path, k.isa)" 2>&1 | tee "$OUT/kernel.txt"
  $PY tests/test_cpu_kernels.py 2>&1 | tee -a "$OUT/kernel.txt"
  $PY -m ftkit.tools.bench.cpu_experts --threads 1,2,4,8,16 --gib 4 --json "$OUT/cpu_experts.json" 2>&1 | tee "$OUT/cpu_experts.txt"
  $PY -m ftkit.tools.bench.cpu_attention --threads 15 2>&1 | tee "$OUT/cpu_attention.txt"
fi
q12() {  # the qwen3-30b-a3b shape cut to 12 layers, written once per machine
  [ -f "$W/q12.ftw/manifest.json" ] || { $PY -m ftkit.tools.bench.cli write --preset qwen3-30b-a3b --layers 12 --out "$W/q12.ftw" 2>&1 | tail -1; sync; }
}  # sync: the kernel's write-back of 14.5 GB would otherwise compete with the CPU branch
qn4() {  # a hybrid-attention model: qwen3-next-80b-a3b cut to 4 layers (12.9 GB of experts)
  [ -f "$W/qn4.ftw/manifest.json" ] || { $PY -m ftkit.tools.bench.cli write --preset qwen3-next-80b-a3b --layers 4 --out "$W/qn4.ftw" 2>&1 | tail -1; sync; }
}
q4km() {  # q12 in llama-quantize's Q4_K_M mix, 4 distinct experts a layer repeated (a quick write)
  [ -f "$W/q4km.ftw/manifest.json" ] || { $PY -m ftkit.tools.bench.cli write --preset qwen3-30b-a3b --layers 12 --quant q4_k_m \
      --distinct-experts 4 --out "$W/q4km.ftw" 2>&1 | tail -1; sync; }
}
L=$W/llama-build
lq4km() {  # llama.cpp built for CUDA from .llama/llama-src.tgz; q12 as a bf16 GGUF, quantized by its
  # llama-quantize to Q4_K_M, converted by ftw-convert (each step resumes where a timeout stopped it)
  if [ ! -x "$L/bin/llama-bench" ]; then
    mkdir -p "$W/llama-src" && tar xzf .llama/llama-src.tgz -C "$W/llama-src"
    { cmake -S "$W/llama-src" -B "$L" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_CURL=OFF \
      && cmake --build "$L" -j "$(nproc)" --target llama-bench llama-quantize; } >> "$OUT/llama-build.txt" 2>&1 \
      || { tail -20 "$OUT/llama-build.txt"; echo "llama.cpp did not build"; return 1; }
  fi
  [ -f "$W/q12-bf16.gguf" ] || $PY -m ftkit.tools.bench.cli write --preset qwen3-30b-a3b --layers 12 --gguf \
      --dtype bfloat16 --distinct-experts 4 --out "$W/q12-bf16.gguf" 2>&1 | tail -1
  [ -f "$W/q12-q4km.gguf" ] || { "$L/bin/llama-quantize" "$W/q12-bf16.gguf" "$W/q12-q4km.tmp" Q4_K_M "$(nproc)" \
      > "$OUT/llama-quantize.txt" 2>&1 && mv "$W/q12-q4km.tmp" "$W/q12-q4km.gguf"; }
  [ -f "$W/lq4km.ftw/manifest.json" ] || $PY -m ftkit.tools.convert "$W/q12-q4km.gguf" -o "$W/lq4km.ftw" 2>&1 | tail -2
}
if has calibrate; then  # CAL_MODEL (q12, q4km, lq4km): B_H of that model's slot formats (ft-calibrate --model)
  cal=(); [ -n "${CAL_MODEL:-}" ] && { $CAL_MODEL; cal=(--model "$W/$CAL_MODEL.ftw"); }
  $PY -m ftkit.tools.calibrate.cli "${cal[@]}" --threads 4,8,15 --working-set 4G --out "$OUT/profile.json" --json 2> "$OUT/calibrate.txt" > /dev/null
  cat "$OUT/calibrate.txt"; PROFILE="$OUT/profile.json"
fi
if has wrong; then
  $PY -m ftkit.tools.bench.wrong_profile "$W" --profile "$PROFILE" --layers 4 --threads 15 --json "$OUT/wrong_profile.json" 2>&1 | tee "$OUT/wrong_profile.txt"
fi
if has gpu; then
  $PY -m pytest -q --tb=short ${GPU_K:+-k "$GPU_K"} ${GPU_TESTS:-tests/test_gpu.py tests/test_triton_experts.py tests/test_triton_decode.py tests/test_triton_attention.py tests/test_graphs.py} > "$OUT/gpu_tests.txt" 2>&1
  tail -15 "$OUT/gpu_tests.txt"
fi
if has zerocopy; then
  $PY -m ftkit.tools.bench.zero_copy ${ZC_FLAGS:-} --json "$OUT/zero_copy.json" 2>&1 | tee "$OUT/zero_copy.txt"
fi
if has gemm; then  # prefill's grouped expert GEMM alone, per format
  $PY -m ftkit.tools.bench.expert_gemm --formats ${GEMM_FORMATS:-bfloat16,mxfp4,q8_0,q4_k_m,iq4_xs,q4_0,q5_0,q2_k,q3_k,q5_k,q6_k,iq4_nl} \
    --json "$OUT/expert_gemm.json" 2>&1 | tee "$OUT/expert_gemm.txt"
fi
if has dense; then  # a decode step's small launches one by one in a CUDA graph (cuBLAS vs Triton GEMV, warps)
  $PY -m ftkit.tools.bench.dense_kernels --json "$OUT/dense_kernels.json" 2>&1 | tee "$OUT/dense_kernels.txt"
fi
if has attn; then
  $PY -m ftkit.tools.bench.chunk_attention --json "$OUT/chunk_attention.json" 2>&1 | tee "$OUT/chunk_attention.txt"
fi
if has read; then
  $PY -m ftkit.tools.bench.ftw_read "$W" --gib 4 --threads 16 --pin 2>&1 | tee "$OUT/ftw_read.txt"
fi
if has hostmem; then  # the loaded pool's read rate per GiB and its pages, in HOSTMEM_RUNS fresh processes,
  m=${HOSTMEM_MODEL:-q12}; $m  # of HOSTMEM_MODEL (q12 or qn4)
  for i in $(seq ${HOSTMEM_RUNS:-1}); do $PY -m ftkit.tools.bench.hostmem -m "$W/$m.ftw" 2>&1 | tee -a "$OUT/hostmem.txt"; done
fi
if has cpubw; then  # the CPU expert kernel alone at the bench's thread count (machines differ), at
  # each of CPU_SHAPES (H,I,experts per call: the q12 and qn4 experts by default), each expert
  # alone (--shared: host-planned hybrid's shared split) and all of a call's together (graph decode's worker)
  for shape in ${CPU_SHAPES:-2048,768,8 2048,512,10}; do
    $PY -m ftkit.tools.bench.cpu_experts --threads 15 --gib 4 --no-torch --shared --shape ${shape%,*} \
        --experts-per-call ${shape##*,} 2>&1 | tail -5 | sed "s/^/$shape /" | tee -a "$OUT/cpubw.txt"
  done
fi
decode() {  # decode on DECODE_MODEL (q12 or q4km; THREADS CPU threads, CACHE_FRACTION; DECODE_FLAGS: more
  # ft-bench flags, e.g. in an AB_ENV_<name>="DECODE_FLAGS=--prompt=512"); $1: strategies, $2: graphs, then more flags
  $PY -m ftkit.tools.bench.cli decode -m "$W/${DECODE_MODEL:-q12}.ftw" --cache-fraction ${CACHE_FRACTION:-0.35} --threads ${THREADS:-15} \
      --profile "$(realpath "$PROFILE")" --tokens ${TOKENS:-32} --strategies "$1" --graphs "$2" ${DECODE_FLAGS:-} "${@:3}"
}
if has decode; then
  ${DECODE_MODEL:-q12}
  decode ${STRATEGIES:-offload,cpu,hybrid} ${GRAPHS:-both} $J "$OUT/decode.json" --trace-dir "$OUT" 2>&1 | tee "$OUT/decode.txt"
fi
if has sampled; then  # hybrid graph decode with each token sampled on the device (temperature, top-p)
  ${DECODE_MODEL:-q12}
  decode hybrid on --temperature 0.7 --top-p 0.95 $J "$OUT/sampled.json" 2>&1 | tee "$OUT/sampled.txt"
fi
if has prefill; then
  q12
  for sp in on off; do
    $PY -m ftkit.tools.bench.cli decode -m "$W/q12.ftw" --cache-fraction 0.35 --threads 15 --profile "$PROFILE" \
        --tokens 2 --chunks 4096,8192 --extend 32 --strategies ${PREFILL_STRATEGIES:-offload,hybrid} --stream-prefill $sp \
        $J "$OUT/prefill-$sp.json" --trace-dir "$OUT/prefill-$sp-trace" 2>&1 | tee "$OUT/prefill-$sp.txt"
  done
fi
extend() {  # the agent turn of the extend part; $1: strategies, $2: turns, then more ft-bench flags
  $PY -m ftkit.tools.bench.cli decode -m "$W/q12.ftw" --cache-fraction 0.35 --threads 15 --profile "$(realpath "$PROFILE")" \
      --tokens 32 --chunks 8192 --answer 32 --extend 32 --strategies "$1" --routing reuse:0.9 --repeat "$2" \
      --graphs ${GRAPHS:-on} "${@:3}"
}
if has serve; then  # ft-run serve through the openai SDK beside the engine (SERVE_MODEL: q12 or q4km; SERVE_FLAGS: more ft-bench serve flags)
  m=${SERVE_MODEL:-q12}; $m
  $PY -m ftkit.tools.bench.cli serve -m "$W/$m.ftw" --device cuda --strategy ${SERVE_STRATEGY:-hybrid} \
      --profile "$(realpath "$PROFILE")" --cache-bytes ${SERVE_CACHE:-4.8G} --threads 15 ${SERVE_FLAGS:-} \
      --log "$OUT/serve${SERVE_TAG:-}.log" $J "$OUT/serve${SERVE_TAG:-}.json" 2>&1 | tee "$OUT/serve${SERVE_TAG:-}.txt"
fi
if has extend; then
  q12
  extend ${EXTEND_STRATEGIES:-offload,hybrid} ${REPEAT:-5} $J "$OUT/extend.json" --trace-dir "$OUT/extend-trace" 2>&1 | tee "$OUT/extend.txt"
fi
if has longctx; then  # graph decode behind long prompts (attention reads the whole context each step)
  q12
  for p in ${PROMPTS:-16 8192 32768}; do
    decode ${STRATEGIES:-hybrid} on --prompt $p $J "$OUT/longctx-$p.json" 2>&1 | tee "$OUT/longctx-$p.txt"
  done
fi
bigprompt() {  # a LONG_CHUNK-token prompt prefilled layer by layer in pieces of $1 tokens (ft-run
  # --prefill-chunk), then a 32-token extend behind it; $2: strategies, then more flags
  $PY -m ftkit.tools.bench.cli decode -m "$W/q12.ftw" --cache-fraction 0.35 --threads 15 --profile "$(realpath "$PROFILE")" \
      --tokens 2 --chunks ${LONG_CHUNK:-32768} --prefill-chunk $1 --extend 32 --repeat ${REPEAT:-1} --strategies "$2" "${@:3}"
}
if has bigprompt; then  # each of PREFILL_CHUNKS
  q12
  for c in ${PREFILL_CHUNKS:-8192 16384 32768}; do
    bigprompt $c ${PREFILL_STRATEGIES:-hybrid} $J "$OUT/bigprompt-$c.json" 2>&1 | tee "$OUT/bigprompt-$c.txt"
  done
fi
nextdecode() {  # decode on the qn4 model; $1: strategies, $2: graphs, then more flags
  $PY -m ftkit.tools.bench.cli decode -m "$W/qn4.ftw" --cache-fraction 0.35 --threads ${THREADS:-15} \
      --profile "$(realpath "$PROFILE")" --tokens ${TOKENS:-32} --strategies "$1" --graphs "$2" "${@:3}"
}
if has nextdecode; then  # three DeltaNet layers (recurrent states) and one gated attention layer
  qn4
  nextdecode ${STRATEGIES:-offload,cpu,hybrid} ${GRAPHS:-both} $J "$OUT/nextdecode.json" --trace-dir "$OUT/nextdecode-trace" 2>&1 | tee "$OUT/nextdecode.txt"
fi
nextprefill() {  # qn4: a LONG_CHUNK-token prompt with a recurrent-state anchor every $1 tokens (0:
  # none), then a 32-token extend; $2: strategies, then more flags
  $PY -m ftkit.tools.bench.cli decode -m "$W/qn4.ftw" --cache-fraction 0.35 --threads 15 --profile "$(realpath "$PROFILE")" \
      --tokens 8 --chunks ${LONG_CHUNK:-32768} --anchors-every $1 --extend 32 --repeat ${REPEAT:-1} --strategies "$2" "${@:3}"
}
if has nextprefill; then  # without anchors and with one every ANCHORS tokens
  qn4
  for a in 0 ${ANCHORS:-2048}; do
    nextprefill $a ${PREFILL_STRATEGIES:-hybrid} $J "$OUT/nextprefill-$a.json" --trace-dir "$OUT/nextprefill-$a-trace" \
        2>&1 | tee "$OUT/nextprefill-$a.txt"
  done
fi
if has llamacpp; then  # llama.cpp and ftkit on one Q4_K_M file (see the header)
  lq4km
  LLAMA_QUANTIZE="$L/bin/llama-quantize" $PY -m pytest -q tests/test_llama_quantize.py > "$OUT/llama-quantize-tests.txt" 2>&1
  tail -1 "$OUT/llama-quantize-tests.txt"
  for n in ${LLAMA_NCMOE:-8 12}; do
    "$L/bin/llama-bench" -m "$W/q12-q4km.gguf" -ngl 99 -ncmoe $n -t ${THREADS:-15} -p 512,4096 -n 128 -r 3 -o md 2>&1 \
      | tee -a "$OUT/llamacpp.txt" | grep -E '^\|'
  done
  for routing in reuse:0 real; do
    $PY -m ftkit.tools.bench.cli decode -m "$W/lq4km.ftw" --cache-fraction ${CACHE_FRACTION:-0.33} --threads ${THREADS:-15} \
        --profile "$(realpath "$PROFILE")" --tokens ${TOKENS:-64} --strategies cpu,hybrid --graphs on --chunks 512,4096 \
        --routing $routing $J "$OUT/llamacpp-ftkit-$routing.json" 2>&1 | tee -a "$OUT/llamacpp.txt" | grep -E 'hybrid|cpu'
  done
fi
if has ab; then  # trees alternated on one machine: AB="ab-old=O1 .=N1 ab-old=O2 .=N2"
  # (dir=name; ab-old: `git archive REV | tar -x -C ab-old`, untracked, so it travels)
  case " ${AB_RUN:-extend} " in *" extend "* | *" bigprompt "*) q12 ;; esac
  case " ${AB_RUN:-extend} " in *" decode "*) ${DECODE_MODEL:-q12} ;; esac
  case " ${AB_RUN:-extend} " in *" nextdecode "* | *" nextprefill "*) qn4 ;; esac
  for run in ${AB:-}; do  # AB_RUN: one or more of extend (REPEAT turns), decode (graph decode),
    d=${run%%=*} name=${run#*=}  # nextdecode (graph decode of qn4), nextprefill (its prompt, anchors
    # every ANCHORS tokens, default none), bigprompt (the first of
    # PREFILL_CHUNKS), zerocopy (the fills bench), cpubw, plan (the planning kernels against the
    # cache's size: copy this tree's dense_kernels.py into an older tree); the first four with AB_STRATEGIES
    $PY -m pip install -q --no-deps --no-build-isolation --no-index -e "$d" >> "$OUT/ab-pip.txt" 2>&1
    J=$(bench_json_flag)
    envs=AB_ENV_$name  # AB_ENV_<name>="VAR=value ...": that run's environment (a switch to compare)
    (
    [ -n "${!envs:-}" ] && export ${!envs}
    for kind in ${AB_RUN:-extend}; do
      case $kind in
        decode) decode ${AB_STRATEGIES:-hybrid} on $J "$OUT/ab-$name-$kind.json" > "$OUT/ab-$name-$kind.txt" 2>&1 ;;
        nextdecode) nextdecode ${AB_STRATEGIES:-hybrid} on $J "$OUT/ab-$name-$kind.json" > "$OUT/ab-$name-$kind.txt" 2>&1 ;;
        bigprompt) c=${PREFILL_CHUNKS:-8192}; bigprompt ${c%% *} ${AB_STRATEGIES:-hybrid} \
            $J "$OUT/ab-$name-$kind.json" > "$OUT/ab-$name-$kind.txt" 2>&1 ;;
        nextprefill) nextprefill ${ANCHORS:-0} ${AB_STRATEGIES:-hybrid} \
            $J "$OUT/ab-$name-$kind.json" > "$OUT/ab-$name-$kind.txt" 2>&1 ;;
        zerocopy) $PY -m ftkit.tools.bench.zero_copy --json "$OUT/ab-$name-$kind.json" > "$OUT/ab-$name-$kind.txt" 2>&1 ;;
        plan) $PY -m ftkit.tools.bench.dense_kernels --only plan --json "$OUT/ab-$name-$kind.json" \
            > "$OUT/ab-$name-$kind.txt" 2>&1; grep -E 'plan' "$OUT/ab-$name-$kind.txt" | sed "s/^/$name /"; continue ;;
        cpubw) for t in ${CPU_TOKENS:-1 9}; do  # the CPU kernel alone, T tokens per expert
            $PY -m ftkit.tools.bench.cpu_experts --threads 15 --gib 2 --seconds 1 --tokens $t --experts-per-call 10 \
                --no-torch 2>&1 | grep -E '^\S* +15 ' | sed "s/^/$name T=$t /"; done; continue ;;
        *) extend ${AB_STRATEGIES:-hybrid} ${REPEAT:-10} $J "$OUT/ab-$name-$kind.json" > "$OUT/ab-$name-$kind.txt" 2>&1 ;;
      esac && $PY -c "import json, sys; out = json.load(open(sys.argv[1]))
if 'runs' not in out:  # the fills bench: fill-through GB/s per kernel and misses
    what = ' '.join(f\"{r['kernel']}x{r['slots']} {r['fill_through_gbps']:.1f}\" for r in out['results'])
else:  # each strategy's run (one line each: the tables stay in the results)
    what = []
    for run in out['runs']:
        d, p = run['decode'], (run['prefill'] or [{}])[0]
        cpu = f\", worker {d['cpu_side_gbps']:.1f} GB/s\" if d.get('cpu_side_gbps') else ''
        pool = run.get('host_pool')
        cpu += f\", pool {pool['huge_fraction']:.0%} huge {pool['numa_gib']}\" if pool else ''
        one = f\"extend {1e3 * p['extend_seconds']:.1f} ms\" if 'extend_seconds' in p else f\"decode {d['tok_s']:.1f} tok/s ({d['of_bound']:.0%} of bound{cpu})\"
        if sys.argv[3] in ('bigprompt', 'nextprefill'):
            one = f\"{p['chunk']}-token prompt in {p['seconds']:.3f} s ({p['missed_gb']:.1f} GB moved), extend {1e3 * p['extend_seconds']:.1f} ms\"
        elif 'seconds' in p:
            one += f\", {p['chunk']}-token prompt {p['seconds']:.3f} s\"
        what.append(f\"{run['strategy']} {one}\")
    what = '; '.join(what)
print(f'{sys.argv[2]}: {what}')" "$OUT/ab-$name-$kind.json" "$name ($d) $kind" $kind || echo "$name ($d) $kind: failed, see ab-$name-$kind.txt"
    done
    )
  done
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . >> "$OUT/ab-pip.txt" 2>&1  # this tree again
fi
true
