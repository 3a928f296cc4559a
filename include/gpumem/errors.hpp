// gpumem's typed errors, thrown by public entry points of every layer.
//
//   out_of_memory    a std::bad_alloc; what() is the full OOM report (requested bytes,
//                    device total/free, what the allocator holds).
//   cuda_error       a CUDA call failed: which call, the CUDA error name and message,
//                    and where in gpumem it was made.
//   invalid_argument bad input refused before any state changed: unknown pointer,
//                    double free, wrong owner, zero or absurd size, bad alignment.
//
// Invariant: an entry point that throws one of these has left its structure as it was
// before the call (internal paths undo partial work first).
#pragma once

#include <new>
#include <stdexcept>
#include <string>

namespace gpumem {

class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(std::string report) : report_(std::move(report)) {}
  const char* what() const noexcept override { return report_.c_str(); }
  const std::string& report() const noexcept { return report_; }

 private:
  std::string report_;
};

class cuda_error : public std::runtime_error {
 public:
  cuda_error(std::string call, int code, std::string code_name, std::string message,
             std::string where)
      : std::runtime_error(call + " failed: " + code_name + " (" + message + ") at " + where),
        call_(std::move(call)),
        code_(code),
        code_name_(std::move(code_name)),
        where_(std::move(where)) {}
  const std::string& call() const noexcept { return call_; }
  int code() const noexcept { return code_; }
  const std::string& code_name() const noexcept { return code_name_; }
  const std::string& where() const noexcept { return where_; }

 private:
  std::string call_;
  int code_;
  std::string code_name_;
  std::string where_;
};

class invalid_argument : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The resource cannot do what was asked (sleep on a caching pool, sharing on a platform
// without it); nothing changed.
class not_supported : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

}  // namespace gpumem
