# Slurm (included from tests/CMakeLists.txt, after ltrain_test_support is defined).

# The allocation read from a fake environment, and the layout it gives a recipe; milliseconds.
ltrain_add_test(slurm_unit_test unit
  SOURCES unit/slurm_test.cc
  LIBS ltrain::common)

if(LTRAIN_BUILD_CONTROL_PLANE AND LTRAIN_BUILD_WORKER)
  # deploy/slurm/ against a real Slurm with two fake nodes on this machine (root, and the packages
  # deploy/setup.sh --tests installs); under a minute. Each test starts that one cluster (its ports,
  # its state directory): one at a time under ctest -j.
  ltrain_add_test(slurm_integration_test integration
    SOURCES slurm/slurm_test.cc
    LIBS ltrain_test_support ltrain::proto
    PROPERTIES RESOURCE_LOCK local_slurm_cluster)
  add_dependencies(slurm_integration_test ltrain ltrain-worker ltrain-exec)
endif()
