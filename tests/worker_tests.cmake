# Tests of the worker runtime and the token data format (included from tests/CMakeLists.txt).
ltrain_add_test(token_data_test unit
  SOURCES unit/token_data_test.cc unit/tokenizer_test.cc unit/prepare_test.cc unit/loader_test.cc
  LIBS ltrain::data)

if(LTRAIN_BUILD_CONTROL_PLANE)
  # Every recipe key, at a value other than its default, from the user's recipe through the
  # coordinator to the worker's loading, and the worker's own environment variables; milliseconds.
  ltrain_add_test(recipe_keys_test unit
    SOURCES unit/recipe_keys_test.cc unit/worker_env_test.cc
    LIBS ltrain::launcher ltrain::worker_control)
endif()

# The ranks' agreement on the step a stop with a final checkpoint ends after (a fake store), and
# the arguments and progress lines of a program run by ltrain-exec and the c10d store it hosts; TensorBoard's
# event records; milliseconds.
ltrain_add_test(checkpoint_stop_test unit
  SOURCES unit/checkpoint_stop_test.cc unit/run_program_test.cc unit/tcp_store_test.cc
  LIBS ltrain::worker_control)
if(TARGET ltrain_test_support)
  ltrain_add_test(tensorboard_events_test unit
    SOURCES unit/tensorboard_events_test.cc
    LIBS ltrain::worker_control ltrain_test_support)
endif()

ltrain_add_test(worker_unit_test unit
  SOURCES unit/gpt_model_test.cc unit/llama_model_test.cc unit/gloo_communicator_test.cc
          unit/trainer_test.cc unit/param_store_test.cc unit/recovery_test.cc unit/fp8_scaling_test.cc
          unit/moe_ops_test.cc unit/context_attention_test.cc
  LIBS ltrain::worker)
target_precompile_headers(worker_unit_test REUSE_FROM ltrain_worker_comm)

# Runs the ltrain-worker binary (1 rank vs 2 Gloo ranks); about a second.
ltrain_add_test(worker_layout_equivalence_test integration
  SOURCES integration/worker_layout_equivalence_test.cc
  LIBS ltrain::data)
add_dependencies(worker_layout_equivalence_test ltrain-worker)
target_compile_definitions(worker_layout_equivalence_test PRIVATE
  LTRAIN_WORKER_BIN="$<TARGET_FILE:ltrain-worker>")

# Pure planners of the parallel runtime (topology, pipeline schedules, buckets, the lr schedule, the
# expert-parallel exchange); milliseconds, linked without LibTorch.
ltrain_add_test(parallel_planner_test unit
  SOURCES unit/parallel_planner_test.cc unit/lr_schedule_test.cc unit/expert_splits_test.cc
  LIBS ltrain::worker_plan)

# Every parallel layout against one process, ZeRO memory at dp=4, sharded resume: real
# ltrain-worker processes (up to 4 at once); about two minutes on 2 cores.
ltrain_add_test(worker_parallel_layouts_test integration
  SOURCES integration/worker_parallel_layouts_test.cc
  LIBS ltrain::data)
add_dependencies(worker_parallel_layouts_test ltrain-worker)
target_compile_definitions(worker_parallel_layouts_test PRIVATE
  LTRAIN_WORKER_BIN="$<TARGET_FILE:ltrain-worker>")

# Checkpoints that lose nothing: corrupt newest skipped, injected write failure, async = sync =
# uninterrupted bit for bit, resharding across dp and ZeRO. Real ltrain-worker processes (1-2 at
# once); about a minute on 2 cores.
ltrain_add_test(checkpoint_test integration
  SOURCES integration/checkpoint_test.cc
  LIBS ltrain::data)
add_dependencies(checkpoint_test ltrain-worker)
target_compile_definitions(checkpoint_test PRIVATE
  LTRAIN_WORKER_BIN="$<TARGET_FILE:ltrain-worker>")

if(LTRAIN_BUILD_CONTROL_PLANE)
  # Checkpoint faults through the real `ltrain launch`: a flipped byte in the newest checkpoint, an
  # injected write failure in the middle of a save.
  ltrain_add_test(checkpoint_faults_test faults
    SOURCES faults/checkpoint_faults_test.cc
    LIBS ltrain_test_support ltrain::proto)
  add_dependencies(checkpoint_faults_test ltrain ltrain-worker)
endif()

# The worker's CUDA kernels against LibTorch; skips without a GPU (run on the GPU host).
ltrain_add_test(fused_kernels_test unit
  SOURCES unit/fused_kernels_test.cc unit/fp8_products_test.cc
  LIBS ltrain::worker)
target_precompile_headers(fused_kernels_test REUSE_FROM worker_unit_test)

# The linear layers' products with and without cuBLASLt epilogues (a benchmark program, not a test;
# only where the worker has CUDA kernels).
if(TARGET ltrain_worker_cuda)
  add_executable(gemm_epilogues bench/gemm_epilogues.cc)
  target_link_libraries(gemm_epilogues PRIVATE ltrain::worker)
  target_compile_options(gemm_epilogues PRIVATE ${LTRAIN_WARNINGS})
endif()

# The NCCL communicator of a job that recovers in place: abort from another thread, calls that fail
# instead of the process, a group made again. Only where the worker has NCCL; skips without a GPU.
if(LTRAIN_WITH_NCCL)
  ltrain_add_test(nccl_communicator_test unit
    SOURCES unit/nccl_communicator_test.cc
    LIBS ltrain::worker)
endif()
