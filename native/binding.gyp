# Build file for the flotilla addon. scripts/find-libtorch.cjs decides where libtorch lives
# (LIBTORCH=/path/to/unzipped/libtorch, else the Debian system packages) and prints it once.
{
  "targets": [
    {
      "target_name": "flotilla",
      "sources": ["addon.cc", "tensor.cc", "tensor_cache.cc", "autograd.cc", "comm.cc", "attention.cc", "pointwise.cc", "optim.cc"],
      "include_dirs": [
        "<!(node -p \"require('node-addon-api').include_dir\")",
        "<!@(node ../scripts/find-libtorch.cjs include)"
      ],
      "libraries": ["<!@(node ../scripts/find-libtorch.cjs libs)"],
      # The loader looks beside the addon first: scripts/trim-libtorch.cjs may put libtorch_cpu there.
      # -fopenmp: at::parallel_for is OpenMP in libtorch's build, so the kernels' loops need it to run in parallel.
      "ldflags": ["-Wl,-rpath,'$$ORIGIN'", "-fopenmp"],
      "defines": ["USE_C10D_GLOO", "NAPI_VERSION=8", "NODE_ADDON_API_DISABLE_DEPRECATED"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti", "-std=gnu++17", "-std=gnu++20"],
      # -O3 and fused multiply-adds: the kernels' loops (attention.cc, pointwise.cc, optim.cc) are written to vectorise;
      # -fno-math-errno lets a square root vectorise (nothing here reads errno after a math function).
      "cflags_cc": ["-std=c++17", "-fexceptions", "-frtti", "-O3", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp", "-Wno-unused-parameter", "-Wno-deprecated-declarations"],
      "cflags!": ["-fno-exceptions"]
    },
    {
      # A copy of libtorch_cpu without the libraries it names but never uses (see the script).
      "target_name": "trim_libtorch",
      "type": "none",
      "dependencies": ["flotilla"],
      "actions": [{
        "action_name": "trim_libtorch",
        "inputs": ["<(PRODUCT_DIR)/flotilla.node", "../scripts/trim-libtorch.cjs"],
        "outputs": ["<(PRODUCT_DIR)/libtorch_cpu.trimmed.json"],
        "action": ["node", "../scripts/trim-libtorch.cjs", "<(PRODUCT_DIR)"]
      }]
    }
  ],
  # The Open MPI backend is a separate addon built only where mpi.h exists (scripts/find-mpi.cjs),
  # so flotilla.node never needs libmpi to load.
  "variables": {"has_mpi": "<!(node ../scripts/find-mpi.cjs has)"},
  "conditions": [
    ["has_mpi==1", {
      "targets": [
        {
          "target_name": "flotilla_mpi",
          "sources": ["mpi.cc"],
          "include_dirs": [
            "<!(node -p \"require('node-addon-api').include_dir\")",
            "<!@(node ../scripts/find-mpi.cjs include)"
          ],
          "libraries": ["<!@(node ../scripts/find-mpi.cjs libs)", "-ldl"],
          "defines": ["NAPI_VERSION=8", "NODE_ADDON_API_DISABLE_DEPRECATED", "OMPI_SKIP_MPICXX=1"],
          "cflags_cc!": ["-fno-exceptions", "-fno-rtti", "-std=gnu++17", "-std=gnu++20"],
          "cflags_cc": ["-std=c++17", "-fexceptions", "-O2", "-Wno-unused-parameter"],
          "cflags!": ["-fno-exceptions"]
        }
      ]
    }]
  ]
}
