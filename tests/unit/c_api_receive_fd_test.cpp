// gpumem_receive_fd against every message a hostile or broken peer can send over the socket:
// short, empty, with no descriptor, with two in one header or in two headers, with more
// than the receiver has room for. Each is answered (the one good message with its
// descriptor, every other with GPUMEM_ERROR_INVALID_ARGUMENT), and the receiving process
// holds exactly the descriptors it held before plus the one returned (counted in
// /proc/self/fd).
#include <gtest/gtest.h>

#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "gpumem/interop/gpumem.h"

namespace {

// The descriptors this process has open.
std::size_t open_fds() {
  std::size_t n = 0;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return 0;
  while (const dirent* e = ::readdir(d))
    if (e->d_name[0] != '.') ++n;
  ::closedir(d);
  return n - 1;  // the directory's own descriptor
}

// A connected pair of Unix stream sockets, closed at the end.
struct socket_pair {
  int fd[2] = {-1, -1};
  socket_pair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fd), 0); }
  ~socket_pair() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
};

// Sends `payload` with the descriptors of `headers` (one SCM_RIGHTS header per entry).
void send_message(int sock, const std::string& payload, const std::vector<std::vector<int>>& headers) {
  iovec io{const_cast<char*>(payload.data()), payload.size()};
  std::size_t space = 0;
  for (const auto& h : headers) space += CMSG_SPACE(sizeof(int) * h.size());
  std::vector<char> control(space + 1);
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  if (space > 0) {
    msg.msg_control = control.data();
    msg.msg_controllen = space;
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    for (const auto& h : headers) {
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int) * h.size());
      std::memcpy(CMSG_DATA(c), h.data(), sizeof(int) * h.size());
      c = CMSG_NXTHDR(&msg, c);
    }
  }
  ASSERT_EQ(::sendmsg(sock, &msg, MSG_NOSIGNAL), static_cast<ssize_t>(payload.size()));
}

// Files to send: their descriptors are closed by the sender after sending, so only what
// the receiver holds stays open.
std::vector<int> files(std::size_t n) {
  std::vector<int> out;
  for (std::size_t k = 0; k < n; ++k) out.push_back(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  return out;
}
void close_all(const std::vector<int>& fds) {
  for (int fd : fds) ::close(fd);
}

const std::string eight_bytes(8, '\x01');

// Sends one message, receives it, and checks the answer and the descriptors left.
void expect_refused_leaving_nothing(const std::string& payload, std::vector<std::size_t> per_header,
                                    const char* what) {
  SCOPED_TRACE(what);
  const socket_pair s;
  const std::size_t before = open_fds();
  {
    std::vector<std::vector<int>> headers;
    for (std::size_t n : per_header) headers.push_back(files(n));
    send_message(s.fd[0], payload, headers);
    for (const auto& h : headers) close_all(h);
  }
  int fd = 12345;
  std::uint64_t size = 0;
  EXPECT_EQ(gpumem_receive_fd(s.fd[1], &fd, &size), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fd, -1);
  EXPECT_NE(std::string(gpumem_last_error()).find("gpumem_receive_fd"), std::string::npos)
      << gpumem_last_error();
  EXPECT_EQ(open_fds(), before) << "descriptors left open by the refused message";
}

TEST(c_api_receive_fd, a_message_of_send_fd_gives_its_descriptor_and_size) {
  const socket_pair s;
  const std::size_t before = open_fds();
  const std::vector<int> one = files(1);
  ASSERT_EQ(gpumem_send_fd(s.fd[0], one[0], 4096), GPUMEM_SUCCESS);
  close_all(one);
  int fd = -1;
  std::uint64_t size = 0;
  ASSERT_EQ(gpumem_receive_fd(s.fd[1], &fd, &size), GPUMEM_SUCCESS) << gpumem_last_error();
  EXPECT_GE(fd, 0);
  EXPECT_EQ(size, 4096u);
  EXPECT_EQ(open_fds(), before + 1);
  ::close(fd);
}

TEST(c_api_receive_fd, every_malformed_message_is_refused_and_its_descriptors_closed) {
  expect_refused_leaving_nothing("abc", {1}, "a short message with a descriptor");
  expect_refused_leaving_nothing(eight_bytes, {2}, "two descriptors in one header");
  expect_refused_leaving_nothing(eight_bytes, {1, 1}, "two headers of one descriptor");
  expect_refused_leaving_nothing(eight_bytes, {3, 2}, "five descriptors in two headers");
  expect_refused_leaving_nothing(eight_bytes, {40}, "more descriptors than the receiver's room");
  expect_refused_leaving_nothing(eight_bytes, {}, "no descriptor");
  expect_refused_leaving_nothing("abc", {}, "a short message alone");
}

TEST(c_api_receive_fd, a_closed_peer_is_refused) {
  socket_pair s;
  ::close(s.fd[0]);
  s.fd[0] = ::open("/dev/null", O_RDONLY);  // closed by the pair's destructor
  int fd = 0;
  EXPECT_EQ(gpumem_receive_fd(s.fd[1], &fd, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fd, -1);
  EXPECT_EQ(gpumem_receive_fd(s.fd[1], nullptr, nullptr), GPUMEM_ERROR_INVALID_ARGUMENT);
}

}  // namespace
