// MPIBackend's errors: an MPI return code as an MpiError naming the user's call and the rank;
// the report of an MpiError to the other ranks; ending the whole job (abort_job, and the
// std::terminate handler that initialize<MPIBackend>() installs).
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>

#include "lockstep/mpi/world.hpp"
#include "mpi/mpi_backend_impl.hpp"

namespace lockstep {

namespace detail {
void check_mpi(int code, const char* call, const std::source_location& loc) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int len = 0;
  MPI_Error_string(code, text, &len);
  int cls = code;
  MPI_Error_class(code, &cls);
  char cls_text[MPI_MAX_ERROR_STRING] = {};
  MPI_Error_string(cls, cls_text, &len);
  // MPI's text once (Open MPI's error string already starts with its class's).
  std::string what = text;
  if (what.find(cls_text) == std::string::npos) what = concat(cls_text, ": ", text);
  // What the user called and where (recorded by the Backend front end); the internal call only
  // when no collective is running.
  const std::string site = t_call_site.known ? describe_call_site() : concat(call, " at ", where(loc));
  throw MpiError(concat(site, " failed in MPI: ", what, rank_suffix()), code);
}
}  // namespace detail

void mpib::report_mpi_error(detail::MPIBackendImpl* impl, const MpiError& e) noexcept {
  if (impl != nullptr) detail::report_mpi_error(impl->monitor.get(), e.what(), e.code());
}

std::string mpib::rank_suffix_noexcept() noexcept {
  try {
    return detail::rank_suffix();
  } catch (...) {
    return "";
  }
}

[[noreturn]] void mpib::terminate_job() noexcept {
  std::string what = "an unknown exception";
  if (std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& ex) {
      what = ex.what();
    } catch (...) {
    }
  } else {
    what = "std::terminate was called without an exception";
  }
  abort_job(detail::concat("uncaught exception: ", what), 1);
}

void abort_job(const std::string& message, int code) noexcept {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  std::cerr << "lockstep: ending the job" << mpib::rank_suffix_noexcept() << ": " << message << std::endl;
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, code == 0 ? 1 : code);
  std::_Exit(code == 0 ? 1 : code);
}

}  // namespace lockstep
