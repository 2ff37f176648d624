# Build file for the flotilla addon. scripts/find-libtorch.cjs decides where libtorch lives
# (LIBTORCH=/path/to/unzipped/libtorch, else the Debian system packages) and prints it once.
{
  "targets": [
    {
      "target_name": "flotilla",
      "sources": ["addon.cc", "tensor.cc", "autograd.cc", "comm.cc"],
      "include_dirs": [
        "<!(node -p \"require('node-addon-api').include_dir\")",
        "<!@(node ../scripts/find-libtorch.cjs include)"
      ],
      "libraries": ["<!@(node ../scripts/find-libtorch.cjs libs)"],
      "defines": ["USE_C10D_GLOO", "NAPI_VERSION=8", "NODE_ADDON_API_DISABLE_DEPRECATED"],
      "cflags_cc!": ["-fno-exceptions", "-fno-rtti", "-std=gnu++17", "-std=gnu++20"],
      "cflags_cc": ["-std=c++17", "-fexceptions", "-frtti", "-O2", "-Wno-unused-parameter", "-Wno-deprecated-declarations"],
      "cflags!": ["-fno-exceptions"]
    }
  ]
}
