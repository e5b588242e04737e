#!/bin/bash
# Builds the plugin objects + the CPU backend + check.cpp into one program (device machine).
set -e
cd "$(dirname "$0")/../../../.."
ROOT=$PWD
NV=$(python3 -c "import nvidia, os; print(os.path.dirname(nvidia.__path__[0]) + '/nvidia')" 2>/dev/null || true)
INC="-I$ROOT/cpp"
LIBS=""
for d in $NV/cu13 $NV/cublas $NV/nccl /usr/local/cuda; do [ -d $d/include ] && INC="$INC -I$d/include"; [ -d $d/lib ] && LIBS="$LIBS -L$d/lib -Xlinker -rpath,$d/lib"; done
OUT=${BUILD_DIR:-/tmp/qrtcheck}
mkdir -p $OUT
ARCH="-gencode=arch=compute_90,code=sm_90"
pids=()
for f in cpp/backend/cuda/*.cu; do
  nvcc -std=c++17 -O3 --expt-relaxed-constexpr $ARCH $INC -Xcompiler -fPIC -c $f -o $OUT/$(basename $f).o & pids+=($!)
done
for f in cpp/backend/cpu/*.cpp cpp/core/dtype.cpp; do
  g++ -std=gnu++17 -O3 -march=native -fopenmp -fPIC -I$ROOT/cpp -c $f -o $OUT/$(basename $f).o & pids+=($!)
done
g++ -std=gnu++17 -O2 -fopenmp $INC -c cpp/backend/cuda/devtest/check.cpp -o $OUT/check.o & pids+=($!)
for p in ${pids[@]}; do wait $p; done
CUBLASLT=$(ls $NV/cu13/lib/libcublasLt.so* $NV/cublas/lib/libcublasLt.so* /usr/local/cuda/lib64/libcublasLt.so* 2>/dev/null | head -1)
NCCL=$(ls $NV/nccl/lib/libnccl.so* /usr/lib/x86_64-linux-gnu/libnccl.so* 2>/dev/null | head -1)
echo "cublasLt: $CUBLASLT nccl: $NCCL"
nvcc -o $OUT/check $OUT/*.o $LIBS -L$(dirname $CUBLASLT) -L$(dirname $NCCL) -Xlinker -rpath,$(dirname $CUBLASLT) -Xlinker -rpath,$(dirname $NCCL) -l:$(basename $CUBLASLT) -l:$(basename $NCCL) -Xcompiler -fopenmp
echo built $OUT/check
