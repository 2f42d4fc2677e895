# The GEMM of the CPU calibrated-attention kernel (plugins/kernels/cpu/gemm.h).
#   ATTNCAL_GEMM=AUTO (default): OpenBLAS from the scipy-openblas32 wheel when the build's Python
#     has it, else the built-in loops, with a notice saying what is missing and what it costs.
#   ATTNCAL_GEMM=openblas | eigen | builtin: that one (openblas and eigen fail when not found).
# docs/native-kernels.md ("GEMM library") has the measured comparison behind the default.
# Sets ATTNCAL_GEMM_USED in the caller's scope (written to attncal_build.json).
set(ATTNCAL_GEMM "AUTO" CACHE STRING "GEMM of the CPU calibrated-attention kernel: AUTO, openblas, eigen or builtin")
set(ATTNCAL_PYTHON "" CACHE FILEPATH "Python whose scipy-openblas32 wheel provides OpenBLAS (default: python3 on PATH)")

function(_attncal_find_openblas inc_var lib_var)
  set(py "${ATTNCAL_PYTHON}")
  if(NOT py AND Python_EXECUTABLE)  # scikit-build-core passes the build environment's interpreter
    set(py "${Python_EXECUTABLE}")
  endif()
  if(NOT py)
    find_program(py NAMES python3 python)
  endif()
  set(${inc_var} "" PARENT_SCOPE)
  set(${lib_var} "" PARENT_SCOPE)
  if(NOT py)
    return()
  endif()
  execute_process(
    COMMAND "${py}" -c "import scipy_openblas32 as s, os; print(s.get_include_dir()); print(os.path.join(s.get_lib_dir(), s.get_library(True)))"
    OUTPUT_VARIABLE out ERROR_QUIET RESULT_VARIABLE rc OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    return()
  endif()
  string(REPLACE "\n" ";" parts "${out}")
  list(GET parts 0 inc)
  list(GET parts 1 lib)
  if(EXISTS "${inc}/cblas.h" AND EXISTS "${lib}")
    set(${inc_var} "${inc}" PARENT_SCOPE)
    set(${lib_var} "${lib}" PARENT_SCOPE)
  endif()
endfunction()

function(attncal_link_gemm target)
  string(TOLOWER "${ATTNCAL_GEMM}" want)
  set(used builtin)
  if(want STREQUAL "auto" OR want STREQUAL "openblas")
    _attncal_find_openblas(ob_inc ob_lib)
    if(ob_lib)
      get_filename_component(ob_dir "${ob_lib}" DIRECTORY)
      target_include_directories(${target} PRIVATE "${ob_inc}")
      target_link_libraries(${target} PRIVATE "${ob_lib}")
      target_compile_definitions(${target} PRIVATE ATTNCAL_GEMM_OPENBLAS)
      # Found at run time beside the wheel it came from (the venv's site-packages).
      set_property(TARGET ${target} APPEND PROPERTY BUILD_RPATH "${ob_dir}")
      # Installed into a platform wheel as site-packages/attncal/lib/: OpenBLAS is then the installed
      # scipy-openblas32 runtime dependency's, two folders up (auditwheel repair --exclude keeps it out).
      set_property(TARGET ${target} APPEND PROPERTY INSTALL_RPATH "$ORIGIN/../../scipy_openblas32/lib")
      set(used openblas)
    elseif(want STREQUAL "openblas")
      message(FATAL_ERROR "ATTNCAL_GEMM=openblas but the scipy-openblas32 wheel was not found in ${ATTNCAL_PYTHON} "
                          "(pip install scipy-openblas32)")
    else()
      message(WARNING "attncal: scipy-openblas32 not found (pip install scipy-openblas32): the calibrated-attention "
                      "kernel uses the built-in GEMM, slower than OpenBLAS (docs/native-kernels.md)")
    endif()
  elseif(want STREQUAL "eigen")
    find_path(EIGEN3_INCLUDE_DIR Eigen/Core PATH_SUFFIXES eigen3)
    if(NOT EIGEN3_INCLUDE_DIR)
      message(FATAL_ERROR "ATTNCAL_GEMM=eigen but Eigen's headers were not found (Debian: libeigen3-dev)")
    endif()
    target_include_directories(${target} PRIVATE "${EIGEN3_INCLUDE_DIR}")
    target_compile_definitions(${target} PRIVATE ATTNCAL_GEMM_EIGEN EIGEN_DONT_PARALLELIZE)
    set(used eigen)
  elseif(NOT want STREQUAL "builtin")
    message(FATAL_ERROR "ATTNCAL_GEMM must be AUTO, openblas, eigen or builtin; got ${ATTNCAL_GEMM}")
  endif()
  message(STATUS "attncal: calibrated-attention GEMM: ${used}")
  set(ATTNCAL_GEMM_USED "${used}" PARENT_SCOPE)
endfunction()
