#!/usr/bin/env bash
# Builds .gpu-wheels for the device machine within carry's 64 MiB (the working tree counts too, ~11 MB): the
# project's abi3 wheel and what the device image lacks (../shared/tools/gpu_wheelhouse.sh), plus PyAV for the audio
# and video scripts and mistral-common's chain for Voxtral / --tokenizer-mode mistral. The image already holds
# pillow, peft, accelerate, tiktoken, regex and attrs (the device library's KINDS.md): not carried. Two wheels are
# slimmed of data ferrox never reads: mistral-common's bundled tokenizers (data/, 36 MB: ferrox reads the model's own
# tekken.json) and pycountry's translations (locales/, 22 MB). Run from the project root:
#     benches/live/gpu_wheels.sh [OUT_DIR]
set -euo pipefail
out=${1:-.gpu-wheels}
../shared/tools/gpu_wheelhouse.sh "$out" av mistral-common jsonschema jsonschema-specifications referencing rpds-py \
  pydantic-extra-types pycountry > /dev/null
slim() {  # slim WHEEL_GLOB DIR_INSIDE: the wheel rewritten without DIR_INSIDE's files (and their RECORD lines)
  local wheel tmp
  wheel=$(realpath "$(ls "$out"/$1)") && tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$wheel" && rm -rf "$2" && sed -i "\#^$2/#d" ./*.dist-info/RECORD && rm "$wheel" \
    && zip -q -r "$wheel" .)
  rm -rf "$tmp"
}
slim "mistral_common-*.whl" mistral_common/data
slim "pycountry-*.whl" pycountry/locales
du -sh "$out"
