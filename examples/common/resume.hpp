// --resume for the training examples (train_lm, train_vision): whether a checkpoint is there to
// continue from, and the housekeeping done at start (docs/reliability.md, "Resuming").
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <system_error>

#include "graphmoe/config.hpp"
#include "graphmoe/train/checkpoint.hpp"

namespace examples {

// True when `path` names something to resume from (load_safetensors then checks that it is a
// regular, well-formed file); false only when nothing at all is there, so that --resume starts
// from scratch. A symbolic link whose target is missing, or a path that cannot be examined
// (permissions), is an error naming the path: silently starting over would overwrite a run.
inline bool checkpoint_to_resume(const std::string& path, const char* program) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status link = fs::symlink_status(path, ec);
  if (link.type() == fs::file_type::not_found) return false;
  GRAPHMOE_CHECK(!ec, program, "--resume: cannot examine '", path, "': ", ec.message());
  if (fs::is_symlink(link)) {
    const fs::file_status target = fs::status(path, ec);
    const std::string to = fs::read_symlink(path, ec).string();
    GRAPHMOE_CHECK(target.type() != fs::file_type::not_found, program, "--resume: '", path,
                   "' is a broken symbolic link (to '", to,
                   "', which does not exist); remove it to start from scratch, or fix it");
  }
  return true;
}

// Removes the stale temporary files of killed saves to `path` (graphmoe::remove_stale_temporaries)
// and says so on stderr.
inline void remove_stale_checkpoint_temporaries(const std::string& path, const char* program) {
  for (const std::string& f : graphmoe::remove_stale_temporaries(path))
    std::fprintf(stderr, "%s: removed the stale temporary file '%s' of an interrupted save\n",
                 program, f.c_str());
}

}  // namespace examples
