// graphmoe/train/datasets.hpp: the data side of the training examples, in one include.
//
//   graphmoe/train/files.hpp           data_dir(), read_file(), for_each_line()
//   graphmoe/train/gzip.hpp            read_file_gunzip() (zlib)
//   graphmoe/train/tokenizers.hpp      WordTokenizer (WikiText), CharTokenizer
//   graphmoe/train/lm_batcher.hpp      LMBatcher: contiguous-stream LM batches
//   graphmoe/train/text_datasets.hpp   SST-2, SST-5, Banking77 readers
//   graphmoe/train/image_datasets.hpp  idx (Fashion-MNIST) and 8x8 digits readers
//
// The gzip and image readers need zlib: a program that uses them links ZLIB::ZLIB
// (find_package(ZLIB REQUIRED)); graphmoe's own target does not.
#pragma once

#include "graphmoe/train/files.hpp"
#include "graphmoe/train/gzip.hpp"
#include "graphmoe/train/image_datasets.hpp"
#include "graphmoe/train/lm_batcher.hpp"
#include "graphmoe/train/text_datasets.hpp"
#include "graphmoe/train/tokenizers.hpp"
