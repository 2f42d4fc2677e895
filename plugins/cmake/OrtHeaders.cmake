# Locates the ONNX Runtime C/C++ headers.  They are not on PyPI or Debian; the
# npm package com.github.asus4.onnxruntime@0.4.9 (MIT) ships the official
# headers (ORT_API_VERSION 29), so the first configure fetches it with
# `npm pack` into ATTNCAL_ORT_HEADER_CACHE (git-ignored) and extracts only the
# header directory.  Set ORT_INCLUDE_DIR to use other headers instead.
set(ATTNCAL_ORT_NPM_PACKAGE "com.github.asus4.onnxruntime@0.4.9")
set(ATTNCAL_ORT_NPM_HEADERS "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers")

function(attncal_find_ort_headers out_var)
  if(ORT_INCLUDE_DIR)
    if(NOT EXISTS "${ORT_INCLUDE_DIR}/onnxruntime_lite_custom_op.h")
      message(FATAL_ERROR "ORT_INCLUDE_DIR=${ORT_INCLUDE_DIR} has no onnxruntime_lite_custom_op.h")
    endif()
    set(${out_var} "${ORT_INCLUDE_DIR}" PARENT_SCOPE)
    return()
  endif()
  set(dest "${ATTNCAL_ORT_HEADER_CACHE}/include")
  if(NOT EXISTS "${dest}/onnxruntime_lite_custom_op.h")
    find_program(NPM_EXECUTABLE npm)
    if(NOT NPM_EXECUTABLE)
      message(FATAL_ERROR "npm is needed once to fetch the ONNX Runtime headers (${ATTNCAL_ORT_NPM_PACKAGE}); "
                          "install npm or pass -DORT_INCLUDE_DIR=<dir with onnxruntime_c_api.h>")
    endif()
    set(work "${ATTNCAL_ORT_HEADER_CACHE}/download")
    file(REMOVE_RECURSE "${work}")
    file(MAKE_DIRECTORY "${work}")
    message(STATUS "attncal: fetching ONNX Runtime headers: npm pack ${ATTNCAL_ORT_NPM_PACKAGE}")
    execute_process(COMMAND "${NPM_EXECUTABLE}" pack "${ATTNCAL_ORT_NPM_PACKAGE}" --silent
                    WORKING_DIRECTORY "${work}" RESULT_VARIABLE rc OUTPUT_VARIABLE tgz ERROR_VARIABLE err
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "npm pack ${ATTNCAL_ORT_NPM_PACKAGE} failed (${rc}): ${err}")
    endif()
    file(GLOB tarballs "${work}/*.tgz")
    list(GET tarballs 0 tarball)
    file(ARCHIVE_EXTRACT INPUT "${tarball}" DESTINATION "${work}/x" PATTERNS "${ATTNCAL_ORT_NPM_HEADERS}/*.h" "package/LICENSE")
    file(GLOB headers "${work}/x/${ATTNCAL_ORT_NPM_HEADERS}/*.h")
    if(NOT headers)
      message(FATAL_ERROR "${ATTNCAL_ORT_NPM_PACKAGE} no longer holds ${ATTNCAL_ORT_NPM_HEADERS}")
    endif()
    # Install atomically: extract to a temp dir, then rename.
    file(MAKE_DIRECTORY "${work}/include")
    file(COPY ${headers} "${work}/x/package/LICENSE" DESTINATION "${work}/include")
    file(REMOVE_RECURSE "${dest}")
    file(RENAME "${work}/include" "${dest}")
    file(REMOVE_RECURSE "${work}")
  endif()
  file(STRINGS "${dest}/onnxruntime_c_api.h" api_line REGEX "^#define ORT_API_VERSION [0-9]+")
  message(STATUS "attncal: ONNX Runtime headers in ${dest} (${api_line})")
  set(${out_var} "${dest}" PARENT_SCOPE)
endfunction()
