// doctest's main, compiled once into the graphmoe_test_main object library.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
