// moe-engine: the whole public C++ API.
#pragma once

#include "moe_engine/checkpoint.hpp"
#include "moe_engine/config.hpp"
#include "moe_engine/device.hpp"
#include "moe_engine/dtype.hpp"
#include "moe_engine/error.hpp"
#include "moe_engine/expert_mlp.hpp"
#include "moe_engine/glu.hpp"
#include "moe_engine/group_layout.hpp"
#include "moe_engine/grouped_linear.hpp"
#include "moe_engine/grouped_param.hpp"
#include "moe_engine/modules.hpp"
#include "moe_engine/offload.hpp"
#include "moe_engine/runtime.hpp"
#include "moe_engine/safetensors.hpp"
#include "moe_engine/tensor.hpp"
#include "moe_engine/workspace.hpp"
