// graphmoe/hf/json.hpp: what the Hugging Face readers share about JSON values (config.json, the
// shard index, tokenizer.json): the kind of a value as error messages name it.
#pragma once

#include <nlohmann/json.hpp>

namespace graphmoe::hf::detail {

// "null", "an object", "an array", "a string", "a boolean", "an integer", "a number".
inline const char* json_kind(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return "null";
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::number_integer:
    case nlohmann::json::value_t::number_unsigned: return "an integer";
    case nlohmann::json::value_t::number_float: return "a number";
    default: return "a value of another kind";
  }
}

}  // namespace graphmoe::hf::detail
