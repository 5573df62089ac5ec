// Must NOT compile: walking a type without LOCKSTEP_FIELDS. The test that compiles this file
// passes when the compiler prints Lockstep's readable static_assert message.
#include <string>

#include "lockstep/core/traverse.hpp"

struct Opaque {
  lockstep::Tensor w;
  std::string name;
};

int main() {
  Opaque o;
  lockstep::for_each_leaf(o, [](auto&) {});
}
