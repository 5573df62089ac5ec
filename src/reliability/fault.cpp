// Fault injection (fault.hpp): LOCKSTEP_FAULT=rank=R,kind=...,after=N,seconds=S. Compiled only
// with LOCKSTEP_FAULT_INJECTION (cmake/LockstepLayers.cmake leaves it out otherwise).
#include "reliability/fault.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>

#include "lockstep/core/errors.hpp"
#include "core/env.hpp"

namespace lockstep::detail {
namespace {

FaultSpec parse_fault(const char* env) {
  FaultSpec f;
  std::string spec = env;
  std::stringstream ss(spec);
  std::string item;
  auto bad = [&](const std::string& why) {
    return InvalidArgument(concat("LOCKSTEP_FAULT=", spec, ": ", why,
                                  " (expected rank=R,kind=delay|freeze|freeze_exchange|skip|shape|dtype|nan|kill|no_segment|rescue_delay[,after=N][,seconds=S])"));
  };
  while (std::getline(ss, item, ',')) {
    auto eq = item.find('=');
    if (eq == std::string::npos) throw bad("item '" + item + "' has no '='");
    std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    char* end = nullptr;
    if (key == "rank" && value == "*") {
      f.rank = kAllRanks;
    } else if (key == "rank") {
      f.rank = static_cast<int>(std::strtol(value.c_str(), &end, 10));
      if (end == value.c_str() || *end != '\0' || f.rank < 0) throw bad("rank must be an integer >= 0");
    } else if (key == "after") {
      f.after = std::strtoll(value.c_str(), &end, 10);
      if (end == value.c_str() || *end != '\0' || f.after < 0) throw bad("after must be an integer >= 0");
    } else if (key == "seconds") {
      f.seconds = std::strtod(value.c_str(), &end);
      if (end == value.c_str() || *end != '\0' || !(f.seconds >= 0)) throw bad("seconds must be >= 0");
    } else if (key == "kind") {
      if (value == "delay") f.kind = FaultKind::delay;
      else if (value == "freeze") f.kind = FaultKind::freeze;
      else if (value == "freeze_exchange") f.kind = FaultKind::freeze_exchange;
      else if (value == "skip") f.kind = FaultKind::skip;
      else if (value == "shape") f.kind = FaultKind::shape;
      else if (value == "dtype") f.kind = FaultKind::dtype;
      else if (value == "nan") f.kind = FaultKind::nan;
      else if (value == "kill") f.kind = FaultKind::kill;
      else if (value == "no_segment") f.kind = FaultKind::no_segment;
      else if (value == "rescue_delay") f.kind = FaultKind::rescue_delay;
      else throw bad("unknown kind '" + value + "'");
    } else {
      throw bad("unknown key '" + key + "'");
    }
  }
  if (f.kind == FaultKind::none) throw bad("kind is missing");
  if (f.rank == -1) throw bad("rank is missing");
  if (f.rank == kAllRanks && f.kind != FaultKind::rescue_delay) throw bad("rank=* is for kind=rescue_delay only");
  return f;
}

const char* fault_name(FaultKind k) {
  switch (k) {
    case FaultKind::none: return "none";
    case FaultKind::delay: return "delay";
    case FaultKind::skip: return "skip";
    case FaultKind::shape: return "shape";
    case FaultKind::dtype: return "dtype";
    case FaultKind::nan: return "nan";
    case FaultKind::kill: return "kill";
    case FaultKind::no_segment: return "no_segment";
    case FaultKind::freeze: return "freeze";
    case FaultKind::freeze_exchange: return "freeze_exchange";
    case FaultKind::rescue_delay: return "rescue_delay";
  }
  return "?";
}

// The whole process stopped, every thread with it (the watchdog too, unlike delay), for
// `seconds`, as a host that stops and comes back: SIGSTOP, and a child that sends SIGCONT. The
// child only sleeps, signals and exits (all async-signal-safe after fork).
void freeze_process(double seconds) {
  const pid_t parent = getpid();
  const pid_t child = fork();
  if (child == 0) {
    timespec ts{static_cast<time_t>(seconds), static_cast<long>((seconds - std::floor(seconds)) * 1e9)};
    while (nanosleep(&ts, &ts) != 0) {
    }
    kill(parent, SIGCONT);
    _exit(0);
  }
  if (child < 0) {  // no process to wake this one: a delay instead
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return;
  }
  std::raise(SIGSTOP);
  waitpid(child, nullptr, 0);
}

// A dtype of the same size, so that an injected dtype fault never reads or writes out of bounds.
DType other_dtype(DType t) {
  switch (t) {
    case DType::f32: return DType::i32;
    case DType::i32: return DType::f32;
    case DType::f64: return DType::i64;
    case DType::i64: return DType::f64;
    case DType::f16: return DType::bf16;
    case DType::bf16: return DType::f16;
    case DType::u8: return DType::u8;
  }
  return t;
}

// Writes a NaN into the first element of a floating host view (integers have none).
void poke_nan(TensorView& v) {
  if (v.numel == 0 || v.data == nullptr || !v.device.is_cpu()) return;
  switch (v.dtype) {
    case DType::f32: static_cast<float*>(v.data)[0] = std::nanf(""); break;
    case DType::f64: static_cast<double*>(v.data)[0] = std::nan(""); break;
    case DType::f16: static_cast<std::uint16_t*>(v.data)[0] = 0x7E00; break;
    case DType::bf16: static_cast<std::uint16_t*>(v.data)[0] = 0x7FC0; break;
    default: break;  // integers have no NaN
  }
}

}  // namespace

const FaultSpec& fault_spec() {
  static const FaultSpec spec = [] {
    const auto value = env::get("LOCKSTEP_FAULT");  // nullopt when unset or empty
    return value ? parse_fault(value->c_str()) : FaultSpec{};
  }();
  return spec;
}

bool inject_fault(const FaultSpec& f, int rank, std::int64_t seq, const char* what, TensorView* data,
                  std::int64_t& count) {
  const auto unix_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  std::cerr << "lockstep: injecting fault kind=" << fault_name(f.kind) << " on rank " << rank << " at collective #"
            << seq << " (" << what << ") at unix time ms " << unix_ms << std::endl;
  switch (f.kind) {
    case FaultKind::delay: std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds)); break;
    case FaultKind::freeze:
    case FaultKind::freeze_exchange: freeze_process(f.seconds); break;
    case FaultKind::skip: return false;
    case FaultKind::shape:
      if (count > 0) --count;
      if (data != nullptr && data->numel > 0) --data->numel;
      break;
    case FaultKind::dtype:
      if (data != nullptr) data->dtype = other_dtype(data->dtype);
      break;
    case FaultKind::nan:
      if (data != nullptr) poke_nan(*data);
      break;
    case FaultKind::kill:
      // The hardest way to die: no destructor, no MPI_Finalize, no message.
      std::raise(SIGKILL);
      break;
    case FaultKind::rescue_delay:  // not a collective's fault: write_rescue_file asks fault_rescue_delay
    case FaultKind::no_segment:  // not a collective's fault: allocate_reduce_buffer asks fault_no_segment
    case FaultKind::none: break;
  }
  return true;
}

}  // namespace lockstep::detail
