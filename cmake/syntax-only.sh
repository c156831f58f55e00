#!/bin/sh
# CXX_COMPILER_LAUNCHER of the examples' syntax-check objects (examples/CMakeLists.txt,
# GRAPHMOE_EXAMPLE_SYNTAX_CHECK): runs the compile command it is given with -fsyntax-only, which
# parses the translation unit and instantiates every template it names (a static_assert or an
# ill-formed call in any of them fails the build) without generating code, then creates the empty
# object file the build expects, so that the check reruns only when a header it read changes (the
# compiler still writes the -MD dependency file).
out=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  prev="$a"
done
"$@" -fsyntax-only || exit $?
[ -n "$out" ] && : > "$out"
