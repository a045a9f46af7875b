#!/bin/bash
# usage: compiles.sh TREE LABEL ; the first step's compiled programs (JAX_LOG_COMPILES) of vmcgrad-vmcsr=256:64
cd $1 && CPU_REGRESSION_CPU=/tmp/h2logs/cpu-$2.json JAX_LOG_COMPILES=1 PYTHONPATH=$1 /work/venv/bin/python -c "$(python3 -c 'import sys; sys.path.insert(0,"/work/h2/benchmarks"); import cpu_regression as c; print(c.STEP_CHILD)')" --dtype float64 --budget-mib 64 --steps 1 --runs vmcgrad-vmcsr=256:64 > /tmp/h2logs/compiles-$2.log 2>&1
grep -o "Finished XLA compilation of [^ ]* in [0-9.]* s" /tmp/h2logs/compiles-$2.log > /tmp/h2logs/compiles-$2.txt
