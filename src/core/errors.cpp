#include "lockstep/core/errors.hpp"

#include <exception>
#include <string_view>

namespace lockstep::detail {

std::string where(const std::source_location& loc) {
  std::string_view file = loc.file_name();
  if (auto slash = file.find_last_of('/'); slash != std::string_view::npos) file.remove_prefix(slash + 1);
  return concat(file, ":", loc.line());
}

// rank_suffix() asks MPI_COMM_WORLD for the rank, so it is defined in the mpi layer
// (src/mpi/world.cpp): nothing in the core includes <mpi.h>.

void throw_invalid(const std::string& msg, const std::source_location& loc) {
  throw InvalidArgument(concat(where(loc), ": ", msg, rank_suffix()));
}

ErrorRecord error_record(const std::exception_ptr& e) {
  ErrorRecord r;
  if (!e) return r;
  try {
    std::rethrow_exception(e);
  } catch (const InvalidArgument& x) {
    r.kind = ErrorKind::invalid_argument, r.what = x.what();
  } catch (const MismatchError& x) {
    r.kind = ErrorKind::mismatch, r.what = x.what();
  } catch (const TimeoutError& x) {
    r.kind = ErrorKind::timeout, r.what = x.what();
  } catch (const CheckpointError& x) {
    r.kind = ErrorKind::checkpoint, r.what = x.what();
  } catch (const NotCompiled& x) {
    r.kind = ErrorKind::not_compiled, r.what = x.what();
  } catch (const MpiError& x) {
    r.kind = ErrorKind::mpi, r.what = x.what(), r.code = x.code();
  } catch (const CudaError& x) {
    r.kind = ErrorKind::cuda, r.what = x.what(), r.code = x.code();
  } catch (const NcclError& x) {
    r.kind = ErrorKind::nccl, r.what = x.what(), r.code = x.code();
  } catch (const RemoteError& x) {
    r.kind = ErrorKind::remote, r.what = x.what(), r.rank = x.rank(), r.function = x.function(), r.message = x.message();
  } catch (const Error& x) {
    r.kind = ErrorKind::error, r.what = x.what();
  } catch (const std::exception& x) {
    r.kind = ErrorKind::std_exception, r.what = x.what();
  } catch (...) {
    r.kind = ErrorKind::unknown;
  }
  return r;
}

void throw_error(const ErrorRecord& r) {
  switch (r.kind) {
    case ErrorKind::invalid_argument: throw InvalidArgument(r.what);
    case ErrorKind::mismatch: throw MismatchError(r.what);
    case ErrorKind::timeout: throw TimeoutError(r.what);
    case ErrorKind::checkpoint: throw CheckpointError(r.what);
    case ErrorKind::not_compiled: throw NotCompiled(r.what);
    case ErrorKind::mpi: throw MpiError(r.what, r.code);
    case ErrorKind::cuda: throw CudaError(r.what, r.code);
    case ErrorKind::nccl: throw NcclError(r.what, r.code);
    case ErrorKind::remote: throw RemoteError(r.rank, r.function, r.message);
    default: throw Error(r.what);
  }
}

}  // namespace lockstep::detail
