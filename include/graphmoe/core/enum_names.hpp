// graphmoe/core/enum_names.hpp: an option enum's values and names in one table, read both ways.
//
// An option enum (NormKind, ExpertLayout, FfnActivation, GraphPrecision, RopeLayout, QKNorm,
// TauMode, MoELayout) declares its table beside it, in the order its names are listed:
//
//   inline constexpr EnumName<NormKind> kNormKindNames[] = {{NormKind::LayerNorm, "layernorm"},
//                                                            {NormKind::RMSNorm, "rmsnorm"}};
//
// and its <enum>_name(value) and <enum>_from_name(text) are name_of / value_of on it, so that a
// command line, a checkpoint's config and an error message name a value the same way.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "graphmoe/config.hpp"

namespace graphmoe {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

// The name of v in table ("?" for a value the table lacks).
template <class E, std::size_t N>
constexpr const char* name_of(const EnumName<E> (&table)[N], E v) {
  for (const EnumName<E>& t : table)
    if (t.value == v) return t.name;
  return "?";
}

// The table's names, in its order (e.g. for a command line's list of choices).
template <class E, std::size_t N>
std::vector<std::string> names_of(const EnumName<E> (&table)[N]) {
  std::vector<std::string> out;
  for (const EnumName<E>& t : table) out.emplace_back(t.name);
  return out;
}

// The table's names joined by ", " (for an error message).
template <class E, std::size_t N>
std::string joined_names(const EnumName<E> (&table)[N]) {
  std::string out;
  for (const EnumName<E>& t : table) out += (out.empty() ? "" : ", ") + std::string(t.name);
  return out;
}

// The entry named `name`, or nullptr.
template <class E, std::size_t N>
const EnumName<E>* find_name(const EnumName<E> (&table)[N], std::string_view name) {
  for (const EnumName<E>& t : table)
    if (name == t.name) return &t;
  return nullptr;
}

// The value named `name`; graphmoe::Error "<op>: unknown <what> '<name>'; valid: a, b" otherwise.
template <class E, std::size_t N>
E value_of(const char* op, const char* what, const EnumName<E> (&table)[N], std::string_view name) {
  if (const EnumName<E>* t = find_name(table, name)) return t->value;
  detail::throw_error(op, "unknown ", what, " '", name, "'; valid: ", joined_names(table));
}

}  // namespace graphmoe
