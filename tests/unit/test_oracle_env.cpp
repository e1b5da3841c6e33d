// OracleEnv: vLLM's variable names, defaults, is_set semantics and parsing (bool(int(v)) with
// Python's error text; .lower() in ("true", "1") for AITER).
#include <gtest/gtest.h>

#include "fp8moe/error.hpp"
#include "fp8moe/oracle_env.hpp"

namespace fp8moe {
namespace {

TEST(OracleEnv, PythonIntTruthy) {
  struct Case {
    const char* text;
    bool value;
  };
  const Case ok[] = {{"1", true},
                     {"0", false},
                     {" 1 ", true},
                     {"\t0\n", false},
                     {"+1", true},
                     {"-0", false},
                     {"-1", true},
                     {"1_0", true},
                     {"0_0", false},
                     {"007", true},
                     {"000", false},
                     {"10", true},
                     {"99999999999999999999999999", true},
                     {"\xc2\xa0"
                      "1",
                      true},
                     {"\x1c"
                      "0",
                      false}};
  for (const auto& c : ok) {
    SCOPED_TRACE(c.text);
    EXPECT_EQ(python_int_truthy(c.text), c.value);
  }
  struct Bad {
    const char* text;
    const char* message;
  };
  const Bad bad[] = {
      {"abc", "invalid literal for int() with base 10: 'abc'"},
      {"", "invalid literal for int() with base 10: ''"},
      {"true", "invalid literal for int() with base 10: 'true'"},
      {"1.0", "invalid literal for int() with base 10: '1.0'"},
      {"_1", "invalid literal for int() with base 10: '_1'"},
      {"1_", "invalid literal for int() with base 10: '1_'"},
      {"1__0", "invalid literal for int() with base 10: '1__0'"},
      {" ", "invalid literal for int() with base 10: ' '"},
      {"+", "invalid literal for int() with base 10: '+'"},
      {"- 1", "invalid literal for int() with base 10: '- 1'"},
      {"0x1", "invalid literal for int() with base 10: '0x1'"},
      {"it's", "invalid literal for int() with base 10: \"it's\""},
      {"a\nb", "invalid literal for int() with base 10: 'a\\nb'"},
  };
  for (const auto& b : bad) {
    SCOPED_TRACE(b.text);
    try {
      python_int_truthy(b.text);
      ADD_FAILURE() << "no error";
    } catch (const ValueError& e) {
      EXPECT_EQ(std::string(e.what()), b.message);
    }
  }
  // CPython cuts the repr to 200 characters (%.200R).
  try {
    python_int_truthy(std::string(300, 'x'));
    ADD_FAILURE();
  } catch (const ValueError& e) {
    EXPECT_EQ(std::string(e.what()),
              "invalid literal for int() with base 10: '" + std::string(199, 'x'));
  }
}

TEST(OracleEnv, PythonRepr) {
  EXPECT_EQ(python_str_repr("abc"), "'abc'");
  EXPECT_EQ(python_str_repr("it's"), "\"it's\"");
  EXPECT_EQ(python_str_repr("a'b\"c"), "'a\\'b\"c'");
  EXPECT_EQ(python_str_repr("back\\slash"), "'back\\\\slash'");
  EXPECT_EQ(python_str_repr("\x01"), "'\\x01'");
  EXPECT_EQ(python_str_repr("\xc2\xa0"), "'\\xa0'");
}

TEST(OracleEnv, DefaultsWhenUnset) {
  const OracleEnv env;
  EXPECT_TRUE(env.use_deep_gemm());
  EXPECT_TRUE(env.moe_use_deep_gemm());
  EXPECT_TRUE(env.use_deep_gemm_e8m0());
  EXPECT_FALSE(env.rocm_use_aiter());
  EXPECT_TRUE(env.rocm_use_aiter_moe());
  EXPECT_FALSE(env.batch_invariant());
  EXPECT_TRUE(env.use_fused_moe_grouped_topk());
  EXPECT_EQ(env.humming_moe_gemm_type(), std::nullopt);
  for (const auto& v : OracleEnv::variables()) EXPECT_FALSE(env.is_set(v.name)) << v.name;
}

TEST(OracleEnv, IsSetWhateverTheValue) {
  OracleEnv env;
  env.set("VLLM_USE_DEEP_GEMM", "1");
  env.set("VLLM_ROCM_USE_AITER", "");
  EXPECT_TRUE(env.is_set("VLLM_USE_DEEP_GEMM"));
  EXPECT_TRUE(env.is_set("VLLM_ROCM_USE_AITER"));
  EXPECT_FALSE(env.is_set("VLLM_MOE_USE_DEEP_GEMM"));
  EXPECT_FALSE(env.rocm_use_aiter());  // "" is not in ("true", "1")
  env.unset("VLLM_USE_DEEP_GEMM");
  EXPECT_FALSE(env.is_set("VLLM_USE_DEEP_GEMM"));
}

TEST(OracleEnv, AiterParsing) {
  struct Case {
    const char* v;
    bool on;
  };
  for (const Case c : {Case{"1", true},
                       {"true", true},
                       {"TRUE", true},
                       {"True", true},
                       {"0", false},
                       {"false", false},
                       {"yes", false},
                       {"2", false},
                       {" 1", false},
                       {"on", false}}) {
    SCOPED_TRACE(c.v);
    OracleEnv env;
    env.set("VLLM_ROCM_USE_AITER", c.v).set("VLLM_ROCM_USE_AITER_MOE", c.v);
    EXPECT_EQ(env.rocm_use_aiter(), c.on);
    EXPECT_EQ(env.rocm_use_aiter_moe(), c.on);
  }
}

TEST(OracleEnv, IntVariablesRaiseLazily) {
  OracleEnv env;
  env.set("VLLM_USE_DEEP_GEMM", "abc").set("VLLM_BATCH_INVARIANT", "yes");
  EXPECT_TRUE(env.is_set("VLLM_USE_DEEP_GEMM"));  // setting never parses
  EXPECT_THROW(env.use_deep_gemm(), ValueError);
  EXPECT_THROW(env.batch_invariant(), ValueError);
  EXPECT_TRUE(env.moe_use_deep_gemm());
}

TEST(OracleEnv, PairsAndErrors) {
  const OracleEnv env = OracleEnv::from_pairs(
      {"VLLM_USE_DEEP_GEMM=0", "VLLM_HUMMING_MOE_GEMM_TYPE=a=b", "VLLM_BATCH_INVARIANT="});
  EXPECT_EQ(env.raw("VLLM_USE_DEEP_GEMM"), "0");
  EXPECT_EQ(env.humming_moe_gemm_type(), "a=b");
  EXPECT_EQ(env.raw("VLLM_BATCH_INVARIANT"), "");
  EXPECT_EQ(env.pairs(),
            (std::vector<std::string>{"VLLM_BATCH_INVARIANT=", "VLLM_HUMMING_MOE_GEMM_TYPE=a=b",
                                      "VLLM_USE_DEEP_GEMM=0"}));
  for (const char* bad : {"VLLM_USE_DEEP_GEMM", "=1", ""}) {
    SCOPED_TRACE(bad);
    try {
      OracleEnv::from_pairs({bad});
      ADD_FAILURE();
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("malformed environment pair '") + bad + "'"),
                std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("NAME=VALUE"), std::string::npos);
    }
  }
  try {
    OracleEnv::from_pairs({"VLLM_USE_DEEPGEMM=1"});
    ADD_FAILURE();
  } catch (const ValueError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'VLLM_USE_DEEPGEMM'"), std::string::npos) << m;
    EXPECT_NE(m.find("VLLM_USE_DEEP_GEMM"), std::string::npos) << m;
  }
  EXPECT_THROW(OracleEnv().is_set("VLLM_NOT_A_VARIABLE"), ValueError);
}

TEST(OracleEnv, FromEnvironmentReadsOnlyKnownVariables) {
  ::setenv("VLLM_MOE_USE_DEEP_GEMM", "0", 1);
  ::setenv("VLLM_SOMETHING_ELSE", "1", 1);
  const OracleEnv env = OracleEnv::from_environment();
  ::unsetenv("VLLM_MOE_USE_DEEP_GEMM");
  ::unsetenv("VLLM_SOMETHING_ELSE");
  EXPECT_TRUE(env.is_set("VLLM_MOE_USE_DEEP_GEMM"));
  EXPECT_FALSE(env.moe_use_deep_gemm());
  for (const auto& p : env.pairs()) EXPECT_EQ(p.rfind("VLLM_SOMETHING_ELSE", 0), std::string::npos);
}

}  // namespace
}  // namespace fp8moe
