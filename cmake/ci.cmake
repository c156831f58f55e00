# cmake/ci.cmake: the test suite's build settings (`cmake -C cmake/ci.cmake ...`, the README's test
# command and .ci/run). CI runs on 2 cores without a GPU and must stay well inside its time limit;
# each setting below cuts what a full matrix builds twice without testing anything more.
# A user's build without this file gets the defaults (every router, sm_80 and sm_90).

# The examples' CPU training loops and routing_report probes: one translation unit per router and
# program (4 programs x 9 routers by default, about 40-90 s of g++ each). The example tests drive
# the softmax router; the library's own tests cover every router. These three cover each token
# graph (independent, similarity, attention), each scorer and each selector once, so that every
# part still compiles inside every training loop.
set(GRAPHMOE_EXAMPLE_ROUTERS "SoftmaxRouter;SimilarityXMoERouter;AttentionSMoEDropoutRouter"
    CACHE STRING "Routers of the examples' CPU training loops (CI subset: cmake/ci.cmake)")

# The examples' --device cuda loops (one nvcc translation unit of a few minutes per router): they
# cannot run without a GPU; one router keeps the loop compiling.
set(GRAPHMOE_CUDA_EXAMPLE_ROUTERS "SoftmaxRouter"
    CACHE STRING "Routers of the examples' --device cuda training loops (CI subset: cmake/ci.cmake)")

# One GPU architecture for the nvcc translation units: sm_80 code plus its PTX, which the driver
# compiles for any later GPU (sm_90 included) at load time. Device code is compiled once per
# architecture, so this halves nvcc's device work; no kernel is architecture-specific.
set(CMAKE_CUDA_ARCHITECTURES "80" CACHE STRING "CUDA architectures (CI: cmake/ci.cmake)")
