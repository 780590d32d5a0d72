// The LibTorch headers the worker uses, precompiled once per target (see worker/CMakeLists.txt).
#pragma once

#include <torch/nn.h>
#include <torch/optim.h>
#include <torch/serialize.h>
