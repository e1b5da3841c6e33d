// The safetensors reader and writer: round trips, lazy mapping, every kind of malformed file, and
// sharded checkpoints with an index. (tests/py/test_safetensors_interop.py checks the same code
// against files written by the reference implementation.)
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "fp8moe/checkpoint.hpp"
#include "fp8moe/error.hpp"
#include "fp8moe/log.hpp"
#include "test_checkpoint_util.hpp"

namespace fp8moe {
namespace {

using test::raw_safetensors;
using test::TempDir;
using test::throws_with;

std::vector<uint8_t> iota_bytes(std::size_t n, uint8_t start = 0) {
  std::vector<uint8_t> v(n);
  std::iota(v.begin(), v.end(), start);
  return v;
}

TEST(Safetensors, WriterRoundTripInMemory) {
  SafetensorsWriter w;
  const auto a = iota_bytes(6);
  std::vector<uint8_t> b(4 * 3);
  const float fb[3] = {1.5f, -2.0f, 0.25f};
  std::memcpy(b.data(), fb, sizeof fb);
  w.add("w.weight", DType::kF8E4M3FN, {2, 3}, a);
  w.add("w.weight_scale_inv", DType::kF32, {1, 3}, b);
  w.add("scale_e8m0", DType::kF8E8M0FNU, {2}, std::vector<uint8_t>{127, 128});
  w.add("empty", DType::kBF16, {0, 4}, std::vector<uint8_t>{});
  w.set_metadata("format", "pt");
  const auto bytes = w.serialize();
  // Header length is a multiple of 8 (space padded), as the reference writer does.
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.size(), 8 + n + 6 + 12 + 2);

  SafetensorsFile f = SafetensorsFile::parse(bytes, "mem.safetensors");
  ASSERT_EQ(f.tensors().size(), 4u);
  EXPECT_EQ(f.tensors()[0].name, "w.weight");  // insertion order
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const SafetensorsTensor& t = f.at("w.weight");
  EXPECT_EQ(t.dtype_name, "F8_E4M3");
  EXPECT_EQ(t.dtype, DType::kF8E4M3FN);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  auto d = f.data(t);
  EXPECT_EQ(std::vector<uint8_t>(d.begin(), d.end()), a);
  auto ds = f.data("w.weight_scale_inv");
  float back[3];
  std::memcpy(back, ds.data(), 12);
  EXPECT_EQ(back[1], -2.0f);
  EXPECT_EQ(f.at("scale_e8m0").dtype_name, "F8_E8M0");
  EXPECT_EQ(f.at("empty").nbytes(), 0u);
  EXPECT_EQ(f.find("nope"), nullptr);
  EXPECT_TRUE(throws_with<FormatError>([&] { f.at("nope"); }, {"mem.safetensors", "'nope'"}));
}

TEST(Safetensors, WriterRejectsBadInput) {
  SafetensorsWriter w;
  EXPECT_TRUE(throws_with<ValueError>(
      [&] {
        w.add("x", DType::kF32, {2, 2}, iota_bytes(15));
      },
      {"'x'", "needs 16 bytes, got 15"}));
  w.add("x", DType::kU8, {1}, iota_bytes(1));
  EXPECT_TRUE(throws_with<ValueError>([&] { w.add("x", DType::kU8, {1}, iota_bytes(1)); },
                                      {"added twice"}));
  EXPECT_THROW(w.add("__metadata__", DType::kU8, {1}, iota_bytes(1)), ValueError);
  EXPECT_THROW(w.add("fnuz", DType::kF8E4M3FNUZ, {1}, iota_bytes(1)), ValueError);
}

TEST(Safetensors, OpenReadsOnlyTheHeaderUntilDataIsAsked) {
  TempDir dir;
  SafetensorsWriter w;
  w.add("a", DType::kU8, {4}, iota_bytes(4, 10));
  w.write(dir.file("m.safetensors"));
  SafetensorsFile f = SafetensorsFile::open(dir.file("m.safetensors"));
  EXPECT_FALSE(f.data_mapped());
  EXPECT_EQ(f.at("a").nbytes(), 4u);
  EXPECT_FALSE(f.data_mapped());
  auto d = f.data("a");
  EXPECT_TRUE(f.data_mapped());
  EXPECT_EQ(d[3], 13);
  SafetensorsFile copy = f;  // copies share the mapping
  EXPECT_EQ(copy.data("a").data(), d.data());
}

TEST(Safetensors, DtypeTable) {
  EXPECT_EQ(safetensors_dtype_bits("F8_E4M3"), 8);
  EXPECT_EQ(safetensors_dtype_bits("BF16"), 16);
  EXPECT_EQ(safetensors_dtype_bits("F4"), 4);
  EXPECT_EQ(safetensors_dtype_bits("F8_E4M3FN"), 0);
  EXPECT_EQ(safetensors_to_dtype("F8_E8M0"), DType::kF8E8M0FNU);
  EXPECT_EQ(safetensors_to_dtype("U8"), DType::kU8);
  EXPECT_EQ(safetensors_to_dtype("U16"), std::nullopt);
  EXPECT_EQ(dtype_to_safetensors(DType::kF8E4M3FN), "F8_E4M3");
  EXPECT_EQ(dtype_to_safetensors(DType::kI32), "I32");
}

TEST(Safetensors, AcceptsEdgeCasesTheReferenceAccepts) {
  // Empty header object, scalars, zero-size tensors sharing an offset, unknown extra fields, and
  // dtypes fp8moe does not compute with.
  EXPECT_NO_THROW(SafetensorsFile::parse(raw_safetensors("{}", 0), "empty"));
  auto f = SafetensorsFile::parse(
      raw_safetensors(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                      R"("z":{"dtype":"F32","shape":[0,3],"data_offsets":[4,4],"extra":1},)"
                      R"("u":{"dtype":"U16","shape":[2],"data_offsets":[4,8]},)"
                      R"("f4":{"dtype":"F4","shape":[4],"data_offsets":[8,10]}})",
                      10),
      "edge");
  EXPECT_EQ(f.at("s").numel(), 1);
  EXPECT_EQ(f.at("z").nbytes(), 0u);
  EXPECT_EQ(f.at("u").dtype, std::nullopt);
  EXPECT_EQ(f.at("f4").nbytes(), 2u);
}

struct Malformed {
  const char* what;
  std::vector<uint8_t> bytes;
  std::vector<std::string> fragments;
};

std::vector<Malformed> malformed_files() {
  const std::string ok_t = R"("t":{"dtype":"U8","shape":[2],"data_offsets":[0,2]})";
  std::vector<Malformed> v;
  v.push_back({"too small", {1, 2, 3}, {"3 bytes", "too small"}});
  v.push_back({"huge header length",
               raw_safetensors("{}", 0, 200'000'000),
               {"header length 200000000", "limit of 100000000"}});
  v.push_back({"header past end", raw_safetensors("{}", 0, 64), {"runs past the end"}});
  v.push_back({"not an object", raw_safetensors("[1,2]", 0), {"must start with '{'"}});
  v.push_back({"leading space", raw_safetensors(" {}", 0), {"must start with '{'"}});
  v.push_back({"invalid json", raw_safetensors("{\"t\":", 0), {"not valid JSON"}});
  v.push_back({"invalid utf-8", raw_safetensors("{\"\xff\":1}", 0), {"not valid JSON"}});
  v.push_back(
      {"duplicate name", raw_safetensors("{" + ok_t + "," + ok_t + "}", 2), {"'t' appears twice"}});
  v.push_back({"metadata not object",
               raw_safetensors(R"({"__metadata__":[1]})", 0),
               {"__metadata__ must be an object"}});
  v.push_back({"metadata value not string",
               raw_safetensors(R"({"__metadata__":{"k":1}})", 0),
               {"__metadata__['k'] must be a string"}});
  v.push_back({"tensor not object",
               raw_safetensors(R"({"t":5})", 0),
               {"tensor 't'", "expected an object"}});
  v.push_back({"missing dtype",
               raw_safetensors(R"({"t":{"shape":[1],"data_offsets":[0,1]}})", 1),
               {"tensor 't'", "\"dtype\""}});
  v.push_back(
      {"unknown dtype",
       raw_safetensors(R"({"t":{"dtype":"F8_E4M3FN","shape":[1],"data_offsets":[0,1]}})", 1),
       {"tensor 't'", "unknown dtype \"F8_E4M3FN\"", "F8_E4M3"}});
  v.push_back({"missing shape",
               raw_safetensors(R"({"t":{"dtype":"U8","data_offsets":[0,1]}})", 1),
               {"tensor 't'", "\"shape\""}});
  v.push_back({"negative dim",
               raw_safetensors(R"({"t":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1),
               {"tensor 't'", "non-negative integers"}});
  v.push_back({"float dim",
               raw_safetensors(R"({"t":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}})", 1),
               {"tensor 't'", "non-negative integers"}});
  v.push_back({"overflowing shape",
               raw_safetensors(R"({"t":{"dtype":"F32","shape":[4294967296,4294967296,4],)"
                               R"("data_offsets":[0,1]}})",
                               1),
               {"tensor 't'", "too large"}});
  v.push_back({"sub-byte size",
               raw_safetensors(R"({"t":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2),
               {"tensor 't'", "whole bytes"}});
  v.push_back({"offsets not a pair",
               raw_safetensors(R"({"t":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1),
               {"tensor 't'", "data_offsets"}});
  v.push_back({"end before begin",
               raw_safetensors(R"({"t":{"dtype":"U8","shape":[0],"data_offsets":[1,0]}})", 1),
               {"tensor 't'", "end before they begin"}});
  v.push_back({"past data region",
               raw_safetensors(R"({"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}})", 2),
               {"tensor 't'", "past the end of the data region (2 bytes)"}});
  v.push_back({"size mismatch",
               raw_safetensors(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4),
               {"tensor 't'", "span 4 bytes", "needs 8 bytes"}});
  v.push_back({"overlap",
               raw_safetensors(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})",
                               6),
               {"'a' [0, 4)", "'b' [2, 6)", "overlap"}});
  v.push_back({"hole",
               raw_safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                               R"("b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}})",
                               6),
               {"bytes [2, 4)", "belong to no tensor", "'b'"}});
  v.push_back({"trailing bytes",
               raw_safetensors(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})", 5),
               {"holds 5 bytes", "cover only 2"}});
  std::string deep(100, '[');
  deep += std::string(100, ']');
  v.push_back({"deep nesting", raw_safetensors("{\"x\":" + deep + "}", 0), {"nesting deeper"}});
  return v;
}

TEST(Safetensors, EveryMalformedFileIsAClearFormatError) {
  for (const auto& m : malformed_files()) {
    SCOPED_TRACE(m.what);
    EXPECT_TRUE(throws_with<FormatError>(
        [&] { SafetensorsFile::parse(m.bytes, "bad.safetensors"); }, {"bad.safetensors"}));
    for (const auto& frag : m.fragments) {
      EXPECT_TRUE(throws_with<FormatError>(
          [&] { SafetensorsFile::parse(m.bytes, "bad.safetensors"); }, {frag}));
    }
  }
}

TEST(Safetensors, MalformedFilesOnDiskNameTheFile) {
  TempDir dir;
  const auto all = malformed_files();
  for (std::size_t i = 0; i < all.size(); ++i) {
    SCOPED_TRACE(all[i].what);
    const std::string path = dir.file("bad" + std::to_string(i) + ".safetensors");
    test::write_bytes(path, all[i].bytes);
    EXPECT_TRUE(throws_with<FormatError>([&] { SafetensorsFile::open(path); }, {path}));
  }
  EXPECT_TRUE(throws_with<ValueError>([&] { SafetensorsFile::open(dir.file("none")); }, {"none"}));
  EXPECT_TRUE(
      throws_with<FormatError>([&] { SafetensorsFile::open(dir.path()); }, {"regular file"}));
}

// ---- sharded checkpoints
// ------------------------------------------------------------------------------

std::vector<ShardedTensor> some_tensors() {
  std::vector<ShardedTensor> ts;
  for (int i = 0; i < 5; ++i) {
    ts.push_back({"layer." + std::to_string(i) + ".weight", DType::kU8, {100}, iota_bytes(100, i)});
  }
  return ts;
}

TEST(SafetensorsCheckpoint, ShardedRoundTrip) {
  TempDir dir;
  write_sharded_checkpoint(dir.path(), some_tensors(), 250);
  SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(dir.path());
  EXPECT_TRUE(ck.sharded());
  EXPECT_EQ(ck.shards().size(), 3u);  // 2 + 2 + 1 tensors of 100 bytes under a 250-byte limit
  EXPECT_EQ(ck.num_tensors(), 5u);
  EXPECT_EQ(ck.total_data_bytes(), 500u);
  EXPECT_FALSE(ck.any_data_mapped());
  auto d = ck.data("layer.3.weight");
  EXPECT_EQ(d[0], 3);
  EXPECT_TRUE(ck.any_data_mapped());
  EXPECT_NE(ck.shard_of("layer.4.weight").path().find("model-00003-of-00003.safetensors"),
            std::string::npos);
  EXPECT_TRUE(throws_with<FormatError>([&] { ck.at("missing"); }, {"'missing'"}));
}

TEST(SafetensorsCheckpoint, SingleFileAndDirectFile) {
  TempDir dir;
  write_sharded_checkpoint(dir.path(), some_tensors(), 1 << 20, /*force_index=*/false);
  SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(dir.path());
  EXPECT_FALSE(ck.sharded());
  EXPECT_EQ(ck.num_tensors(), 5u);
  SafetensorsCheckpoint direct = SafetensorsCheckpoint::open(dir.file("model.safetensors"));
  EXPECT_EQ(direct.num_tensors(), 5u);
}

TEST(SafetensorsCheckpoint, IndexErrorsNameTheProblem) {
  TempDir dir;
  write_sharded_checkpoint(dir.path(), some_tensors(), 250);
  const std::string index = dir.file("model.safetensors.index.json");
  const std::string s1 = "model-00001-of-00003.safetensors";
  const std::string s2 = "model-00002-of-00003.safetensors";
  struct Case {
    const char* what;
    std::string text;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"not json", "{", {"not valid JSON"}},
      {"no weight_map", R"({"metadata":{}})", {"weight_map"}},
      {"empty weight_map", R"({"weight_map":{}})", {"empty"}},
      {"non-string shard", R"({"weight_map":{"layer.0.weight":3}})", {"'layer.0.weight'"}},
      {"missing shard",
       R"({"weight_map":{"layer.0.weight":"gone.safetensors"}})",
       {"'gone.safetensors'", "does not exist", "'layer.0.weight'"}},
      {"escaping path",
       R"({"weight_map":{"layer.0.weight":"../x.safetensors"}})",
       {"not a file name inside the model folder"}},
      {"tensor not in shard",
       R"({"weight_map":{"layer.4.weight":")" + s1 + R"("}})",
       {"'layer.4.weight'", s1, "does not contain it"}},
      {"bad total_size",
       R"({"metadata":{"total_size":"big"},"weight_map":{"layer.0.weight":")" + s1 + R"("}})",
       {"total_size"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    test::write_text(index, c.text);
    bool threw = false;
    try {
      SafetensorsCheckpoint::open(dir.path());
    } catch (const Error& e) {
      threw = true;
      const std::string msg = e.what();
      for (const auto& f : c.fragments) EXPECT_NE(msg.find(f), std::string::npos) << msg;
    }
    EXPECT_TRUE(threw);
  }
  // A tensor stored in two shards.
  {
    SafetensorsWriter w;
    w.add("layer.0.weight", DType::kU8, {100}, iota_bytes(100));
    w.add("layer.2.weight", DType::kU8, {100}, iota_bytes(100));
    w.write(dir.file(s2));
    test::write_text(index, R"({"weight_map":{"layer.0.weight":")" + s1 +
                                R"(","layer.2.weight":")" + s2 + R"("}})");
    EXPECT_TRUE(throws_with<FormatError>([&] { SafetensorsCheckpoint::open(dir.path()); },
                                         {"'layer.0.weight'", "stored in both"}));
  }
  // A malformed shard is reported with its own path.
  {
    test::write_bytes(dir.file(s2), raw_safetensors("{", 0));
    test::write_text(index, R"({"weight_map":{"layer.0.weight":")" + s2 + R"("}})");
    EXPECT_TRUE(throws_with<FormatError>([&] { SafetensorsCheckpoint::open(dir.path()); }, {s2}));
  }
}

TEST(SafetensorsCheckpoint, UnlistedTensorsWarnAndAreIgnored) {
  TempDir dir;
  write_sharded_checkpoint(dir.path(), some_tensors(), 250);
  const std::string s1 = "model-00001-of-00003.safetensors";
  test::write_text(dir.file("model.safetensors.index.json"),
                   R"({"weight_map":{"layer.0.weight":")" + s1 + R"("}})");
  std::vector<std::string> logs;
  set_log_sink([&](LogLevel, std::string_view m) { logs.emplace_back(m); });
  SafetensorsCheckpoint ck = SafetensorsCheckpoint::open(dir.path());
  set_log_sink(nullptr);
  EXPECT_EQ(ck.num_tensors(), 1u);
  EXPECT_EQ(ck.find("layer.1.weight"), nullptr);
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_NE(logs[0].find("'layer.1.weight'"), std::string::npos);
}

TEST(SafetensorsCheckpoint, EmptyDirectoryExplainsWhatIsMissing) {
  TempDir dir;
  EXPECT_TRUE(throws_with<FormatError>([&] { SafetensorsCheckpoint::open(dir.path()); },
                                       {"no model.safetensors.index.json or model.safetensors"}));
  SafetensorsWriter w;
  w.add("a", DType::kU8, {1}, iota_bytes(1));
  w.write(dir.file("consolidated.safetensors"));
  EXPECT_TRUE(throws_with<FormatError>([&] { SafetensorsCheckpoint::open(dir.path()); },
                                       {"consolidated.safetensors", "pass one directly"}));
  EXPECT_TRUE(throws_with<ValueError>([&] { SafetensorsCheckpoint::open(dir.file("nothing")); },
                                      {"no such file"}));
}

}  // namespace
}  // namespace fp8moe
