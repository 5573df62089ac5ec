/* Preloaded only in the sanitizer stage (scripts/ci-sanitize.sh): makes dlclose a no-op, so that
 * the Open MPI components loaded with dlopen stay mapped until exit. LeakSanitizer reports leaks
 * at exit; without this, allocations made inside components Open MPI already unloaded show as
 * "<unknown module>" and cannot be matched by the Open MPI suppressions. */
int dlclose(void* handle) {
  (void)handle;
  return 0;
}
