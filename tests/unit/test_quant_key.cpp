// QuantKey strings, equality, the named keys and the key parser (vLLM quant_utils.py).
#include <gtest/gtest.h>

#include "fp8moe/error.hpp"
#include "fp8moe/experts.hpp"
#include "fp8moe/quant_key.hpp"

namespace fp8moe {
namespace {

struct KeyStr {
  const QuantKey* key;
  const char* name;
  const char* str;
};

TEST(QuantKey, StrMatchesVllmForEveryNamedKey) {
  const KeyStr cases[] = {
      {&kFp8StaticTensorSym, "kFp8StaticTensorSym",
       "QuantKey(f8e4m3fn,scale(f32,static,per_tensor),symmetric)"},
      {&kFp8DynamicTensorSym, "kFp8DynamicTensorSym",
       "QuantKey(f8e4m3fn,scale(f32,dynamic,per_tensor),symmetric)"},
      {&kFp8StaticTokenSym, "kFp8StaticTokenSym",
       "QuantKey(f8e4m3fn,scale(f32,static,per_token),symmetric)"},
      {&kFp8StaticChannelSym, "kFp8StaticChannelSym",
       "QuantKey(f8e4m3fn,scale(f32,static,per_channel),symmetric)"},
      {&kFp8DynamicTokenSym, "kFp8DynamicTokenSym",
       "QuantKey(f8e4m3fn,scale(f32,dynamic,per_token),symmetric)"},
      {&kFp8Dynamic128Sym, "kFp8Dynamic128Sym",
       "QuantKey(f8e4m3fn,scale(f32,dynamic,GroupShape(row=1, col=128)),symmetric)"},
      {&kFp8Static128BlockSym, "kFp8Static128BlockSym",
       "QuantKey(f8e4m3fn,scale(f32,static,GroupShape(row=128, col=128)),symmetric)"},
      {&kFp8Dynamic64Sym, "kFp8Dynamic64Sym",
       "QuantKey(f8e4m3fn,scale(f32,dynamic,GroupShape(row=1, col=64)),symmetric)"},
      {&kMxfp8Static, "kMxfp8Static",
       "QuantKey(f8e4m3fn,scale(u8,static,GroupShape(row=1, col=32)),symmetric)"},
      {&kMxfp8Dynamic, "kMxfp8Dynamic",
       "QuantKey(f8e4m3fn,scale(u8,dynamic,GroupShape(row=1, col=32)),symmetric)"},
      {&kMxfp4Static, "kMxfp4Static",
       "QuantKey(u8,scale(u8,static,GroupShape(row=1, col=32)),symmetric)"},
      {&kNvfp4Static, "kNvfp4Static",
       "QuantKey(u8,scale(f8e4m3fn,static,GroupShape(row=1, col=16)),scale2(f32,static,"
       "per_tensor),symmetric)"},
      {&kNvfp4Dynamic, "kNvfp4Dynamic",
       "QuantKey(u8,scale(f8e4m3fn,dynamic,GroupShape(row=1, col=16)),scale2(f32,static,"
       "per_tensor),symmetric)"},
      {&kInt8StaticChannelSym, "kInt8StaticChannelSym",
       "QuantKey(i8,scale(f32,static,per_channel),symmetric)"},
      {&kInt8DynamicTokenSym, "kInt8DynamicTokenSym",
       "QuantKey(i8,scale(f32,dynamic,per_token),symmetric)"},
      {&kInt4StaticAsym, "kInt4StaticAsym",
       "QuantKey(uint4,scale(f32,static,GroupShape(row=1, col=128)),asymmetric)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(c.key->str(), c.str);
    EXPECT_EQ(quant_key_name(*c.key), c.name);
    EXPECT_EQ(parse_quant_key(c.name), OptQuantKey(*c.key));
  }
  EXPECT_EQ(key_str(std::nullopt), "None");
  EXPECT_EQ(quant_key_name(std::nullopt), "none");
}

TEST(QuantKey, CreateFp8QuantKeyEqualsTheNamedKeys) {
  EXPECT_EQ(create_fp8_quant_key(true, GroupShape(128, 128)), kFp8Static128BlockSym);
  EXPECT_EQ(create_fp8_quant_key(false, GroupShape(1, 128)), kFp8Dynamic128Sym);
  EXPECT_EQ(create_fp8_quant_key(true, kPerTensor), kFp8StaticTensorSym);
  EXPECT_NE(create_fp8_quant_key(true, GroupShape(64, 64)), kFp8Static128BlockSym);
  EXPECT_NE(create_fp8_quant_key(true, GroupShape(128, 128), false), kFp8Static128BlockSym);
  EXPECT_EQ(create_fp8_quant_key(true, GroupShape(64, 64)).str(),
            "QuantKey(f8e4m3fn,scale(f32,static,GroupShape(row=64, col=64)),symmetric)");
}

TEST(QuantKey, GroupShapePredicates) {
  EXPECT_TRUE(kPerTensor.is_per_tensor());
  EXPECT_TRUE(kPerToken.is_per_token());
  EXPECT_TRUE(kPerChannel.is_per_channel());
  EXPECT_TRUE(GroupShape(1, 128).is_per_group());
  EXPECT_EQ(GroupShape(128, 128).str(), "GroupShape(row=128, col=128)");
}

TEST(QuantKey, GenericForms) {
  EXPECT_EQ(parse_quant_key("fp8:static:64x64"), OptQuantKey(create_fp8_quant_key(true, {64, 64})));
  EXPECT_EQ(parse_quant_key("fp8:dynamic:1x128"), OptQuantKey(kFp8Dynamic128Sym));
  EXPECT_EQ(parse_quant_key("fp8:static:tensor"), OptQuantKey(kFp8StaticTensorSym));
  EXPECT_EQ(parse_quant_key("fp8:dynamic:token"), OptQuantKey(kFp8DynamicTokenSym));
  EXPECT_EQ(parse_quant_key("fp8:static:channel"), OptQuantKey(kFp8StaticChannelSym));
  EXPECT_EQ(parse_quant_key("none"), std::nullopt);
  EXPECT_EQ(parse_quant_key("fp8_e4m3fnuz:static:128x128")->dtype, KeyDType::kF8E4M3FNUZ);
}

TEST(QuantKey, BadKeysNameTheValue) {
  for (const char* bad : {"kFp8Static128Block", "fp8:static", "fp8:static:0x64", "fp8:foo:64x64",
                          "int8:static:64x64", "fp8:static:64x", "fp8:static:-1x64"}) {
    SCOPED_TRACE(bad);
    try {
      parse_quant_key(bad);
      ADD_FAILURE() << "no error";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("expected"), std::string::npos);
    }
  }
}

TEST(QuantKey, PlatformFlavourSwapsOnlyFp8Dtypes) {
  const QuantKey fnuz = with_fp8_dtype(kFp8Static128BlockSym, KeyDType::kF8E4M3FNUZ);
  EXPECT_EQ(fnuz.str(),
            "QuantKey(f8e4m3fnuz,scale(f32,static,GroupShape(row=128, col=128)),symmetric)");
  EXPECT_EQ(with_fp8_dtype(kNvfp4Static, KeyDType::kF8E4M3FNUZ).scale.dtype, KeyDType::kF8E4M3FNUZ);
  EXPECT_EQ(with_fp8_dtype(kInt8StaticChannelSym, KeyDType::kF8E4M3FNUZ), kInt8StaticChannelSym);
  EXPECT_EQ(with_fp8_dtype(fnuz, KeyDType::kF8E4M3FN), kFp8Static128BlockSym);
  EXPECT_EQ(with_fp8_dtype(OptQuantKey{}, KeyDType::kF8E4M3FNUZ), std::nullopt);
}

}  // namespace
}  // namespace fp8moe
