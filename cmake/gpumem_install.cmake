# The installed package: headers, libgpumem.so / libgpumem.a, libgpumem_torch.so, the
# gpumem tool, the Python package, gpumemConfig.cmake (+ version file) and gpumem.pc.
#
#   find_package(gpumem 0.1 REQUIRED)
#   target_link_libraries(app PRIVATE gpumem::gpumem)          # the shared library
#   target_link_libraries(app PRIVATE gpumem::gpumem_static)   # where its deps are found
#
# The static library links CUDA's static runtime (when built with the CUDA toolkit), zlib
# and hiredis (when found) privately: the export lists them as $<LINK_ONLY:...>, so gpumemConfig.cmake looks for
# them and defines gpumem::gpumem_static only when they are found (else it says why). The
# shared library needs nothing beyond Threads.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(GPUMEM_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/gpumem)

install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/gpumem
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} FILES_MATCHING PATTERN "*.h" PATTERN "*.hpp")
install(TARGETS gpumem EXPORT gpumemTargets
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS gpumem_static EXPORT gpumemStaticTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS gpumem_torch LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
install(TARGETS gpumem_cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# python/gpumem finds the plug-in at PREFIX/lib*/ from here (see its load()). Python does
# not look in share/: `pip install .` (docs/PYTORCH.md) is the way to a package Python
# imports; or GPUMEM_PYTHON_INSTALL_DIR names a folder on Python's path (a site-packages),
# where the package goes with the plug-in inside it and gpumem-enable.pth beside it, as
# pip puts them.
install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/gpumem
        DESTINATION ${CMAKE_INSTALL_DATADIR}/gpumem/python PATTERN "__pycache__" EXCLUDE)
set(GPUMEM_PYTHON_INSTALL_DIR "" CACHE STRING
    "Also install the Python package (with libgpumem_torch.so inside) into this folder on Python's path (relative: to the prefix)")
if(GPUMEM_PYTHON_INSTALL_DIR)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/python/gpumem
          DESTINATION ${GPUMEM_PYTHON_INSTALL_DIR} PATTERN "__pycache__" EXCLUDE)
  install(TARGETS gpumem_torch LIBRARY DESTINATION ${GPUMEM_PYTHON_INSTALL_DIR}/gpumem)
  install(FILES ${PROJECT_SOURCE_DIR}/python/gpumem-enable.pth DESTINATION ${GPUMEM_PYTHON_INSTALL_DIR})
endif()

install(EXPORT gpumemTargets NAMESPACE gpumem:: DESTINATION ${GPUMEM_CMAKE_DIR})
install(EXPORT gpumemStaticTargets NAMESPACE gpumem:: DESTINATION ${GPUMEM_CMAKE_DIR})

# What the static library's link needs, for gpumemConfig.cmake and gpumem.pc.
set(GPUMEM_PACKAGE_NEEDS_CUDA ${GPUMEM_HAVE_CUDA})
set(GPUMEM_PACKAGE_NEEDS_ZLIB ${ZLIB_FOUND})
set(GPUMEM_PACKAGE_NEEDS_HIREDIS ${GPUMEM_HAVE_HIREDIS})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/gpumemConfig.cmake.in
  ${CMAKE_CURRENT_BINARY_DIR}/gpumemConfig.cmake INSTALL_DESTINATION ${GPUMEM_CMAKE_DIR})
# 0.x: a minor version may break the API, so only the same minor is compatible.
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/gpumemConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/gpumemConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/gpumemConfigVersion.cmake
        DESTINATION ${GPUMEM_CMAKE_DIR})

# pkg-config: relocatable (prefix from the .pc file's own place), so
# `cmake --install --prefix` anywhere gives a correct file.
string(REGEX REPLACE "[^/]+" ".." GPUMEM_PC_UP "${CMAKE_INSTALL_LIBDIR}/pkgconfig")
set(GPUMEM_PC_LIBS_PRIVATE "-lpthread")
if(CMAKE_DL_LIBS)
  string(APPEND GPUMEM_PC_LIBS_PRIVATE " -l${CMAKE_DL_LIBS}")
endif()
if(GPUMEM_HAVE_CUDA)
  string(APPEND GPUMEM_PC_LIBS_PRIVATE " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -lrt")
endif()
if(ZLIB_FOUND)
  string(APPEND GPUMEM_PC_LIBS_PRIVATE " -lz")
endif()
if(GPUMEM_HAVE_HIREDIS)
  string(APPEND GPUMEM_PC_LIBS_PRIVATE " -lhiredis")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/gpumem.pc.in ${CMAKE_CURRENT_BINARY_DIR}/gpumem.pc @ONLY)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/gpumem.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
