// core/enum_names.hpp and the option enums' tables: every value's name reads back to the value,
// the names are distinct and in the order the command lines list them, and an unknown name is
// refused with the valid ones listed.
#include <doctest/doctest.h>

#include <set>
#include <string>
#include <vector>

#include "graphmoe/core/enum_names.hpp"
#include "graphmoe/models/transformer_lm.hpp"

using namespace graphmoe;

namespace {

// Every entry of the table: name_of gives its name, from_name its value; names distinct.
template <class E, std::size_t N, class NameFn, class FromFn>
void check_round_trip(const EnumName<E> (&table)[N], NameFn name, FromFn from) {
  std::set<std::string> seen;
  for (const EnumName<E>& t : table) {
    CHECK(std::string(name(t.value)) == t.name);
    CHECK(from(t.name) == t.value);
    CHECK(seen.insert(t.name).second);
  }
  CHECK(names_of(table).size() == N);
}

}  // namespace

TEST_CASE("enum names: every option enum's names read both ways") {
  check_round_trip(kNormKindNames, norm_kind_name, norm_kind_from_name);
  check_round_trip(kExpertLayoutNames, expert_layout_name, expert_layout_from_name);
  check_round_trip(kFfnActivationNames, ffn_activation_name, ffn_activation_from_name);
  check_round_trip(kGraphPrecisionNames, graph_precision_name, graph_precision_from_name);
  check_round_trip(kRopeLayoutNames, rope_layout_name, rope_layout_from_name);
  check_round_trip(kTauModeNames, tau_mode_name, tau_mode_from_name);
  check_round_trip(kMoELayoutNames, moe_layout_name, moe_layout_from_name);
  check_round_trip(kQKNormNames, [](QKNorm q) { return name_of(kQKNormNames, q); },
                   qk_norm_from_name);
}

TEST_CASE("enum names: the names the command lines and checkpoints use") {
  CHECK(names_of(kNormKindNames) == std::vector<std::string>{"layernorm", "rmsnorm"});
  CHECK(names_of(kQKNormNames) == std::vector<std::string>{"none", "full", "per-head"});
  CHECK(names_of(kMoELayoutNames) == std::vector<std::string>{"switch", "glam", "dense"});
  CHECK(names_of(kTauModeNames) == std::vector<std::string>{"fixed", "scaled", "learned"});
  CHECK(names_of(kRopeLayoutNames) == std::vector<std::string>{"half-split", "interleaved"});
  CHECK(std::string(graph_precision_name(GraphPrecision::BF16)) == "bf16");
  CHECK(std::string(name_of(kNormKindNames, static_cast<NormKind>(7))) == "?");
}

TEST_CASE("enum names: an unknown name is refused, naming the valid ones") {
  CHECK_THROWS_WITH_AS(norm_kind_from_name("batchnorm"),
                       "graphmoe::norm_kind_from_name: unknown norm 'batchnorm'; valid: "
                       "layernorm, rmsnorm",
                       Error);
  CHECK_THROWS_WITH_AS(qk_norm_from_name(""),
                       "graphmoe::qk_norm_from_name: unknown QK-norm ''; valid: none, full, per-head",
                       Error);
  CHECK_THROWS_AS(moe_layout_from_name("Switch"), Error);  // names are case-sensitive
}
